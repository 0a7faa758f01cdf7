"""vLLM's tiering API, imported once, for the vLLM versions this adapter is tested with.

vLLM marks its secondary-tier API experimental (`SecondaryTierFactory` warns
when it loads an out-of-tree tier), so the adapter pins the releases it was
tested against and refuses any other with an ImportError that says which are
supported, rather than misbehaving against a changed contract. Imports only
the light modules (tiering.base, tiering.factory, kv_offload.base: numpy,
msgspec, pyzmq, urllib3 beyond vLLM itself). Must not import vLLM's engine,
CUDA kernels or file tier.
"""
from importlib import metadata

# Releases whose SecondaryTierManager / TransferJob / JobResult / SharedOffloadRegion
# this adapter was tested with (tests/integrations/test_vllm_tier.py).
SUPPORTED_VLLM = ("0.33.0",)
INSTALL_HINT = ("pip install vllm==0.33.0 (for tests: pip install --no-deps -r "
                ".ci/vllm-requirements.txt)")


def vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def check_version(version: str | None) -> None:
    """ImportError unless `version` is a supported release (a local build tag
    such as +cu130 is allowed, a dev or other release is not)."""
    if version is None:
        raise ImportError("hicache_mp.integrations.vllm is a vLLM KV-offloading tier and needs "
                          f"vLLM (supported: {', '.join(SUPPORTED_VLLM)}); it is not "
                          f"installed: {INSTALL_HINT}")
    release = version.split("+", 1)[0]
    if release not in SUPPORTED_VLLM:
        raise ImportError(f"hicache_mp.integrations.vllm supports vLLM "
                          f"{', '.join(SUPPORTED_VLLM)} (its secondary-tier API is "
                          f"experimental and changes between releases); this is vLLM "
                          f"{version}. {INSTALL_HINT}")


check_version(vllm_version())

try:
    from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadingEvent, \
        RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as _exc:  # pragma: no cover - a broken vLLM install
    raise ImportError(f"hicache_mp.integrations.vllm: vLLM {vllm_version()}'s tiering API "
                      f"could not be imported ({_exc}). {INSTALL_HINT}") from _exc

__all__ = ["Locality", "LookupResult", "Medium", "OffloadingEvent", "RequestOffloadingContext",
           "JobResult", "SecondaryTierManager", "TransferJob", "SUPPORTED_VLLM",
           "check_version", "vllm_version"]
