"""The SGLang adapter's extra-config keys: its own settings and the keys SGLang reads.

Owns `AdapterConfig` (the adapter's own keys, declared as the engine's are,
hicache_mp.engine.config.setting), the keys SGLang's own loader reads, and where the
store lives when the extra config does not say. Imports no SGLang or torch,
so the flags reference (hicache_mp.flagsdoc) is written without them. Must
not start anything.
"""
import math
import os
from dataclasses import dataclass

from ...engine.config import parse_value, setting, settings
from ..common import settable_keys

DEFAULT_STORAGE_DIR = "/tmp/hicache_mp"
DEFAULT_STAGING_PAGES = 256  # two of SGLang's STORAGE_BATCH_SIZE (128) batches in flight
# Extra-config keys SGLang itself reads (its dynamic loader and allocator switches).
SGLANG_OWN_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size", "file_storage_path"})


@dataclass
class AdapterConfig:
    """This adapter's own extra-config keys, declared as the engine's are (hicache_mp.engine.config)."""
    staging_pages: int = setting(DEFAULT_STAGING_PAGES, "staging pool size on the non-zero-copy "
                                 "path", sglang=True, lo=1)
    io_timeout_s: float = setting(math.inf, "give up on a batch after this long: its "
                                  "unfinished pages are reported False", sglang=True, lo=0,
                                  lo_open=True, finite=False)
    zero_copy: bool = setting(True, "false forces the staging path", sglang=True)
    sidecar_staging_bytes: int = setting(
        64 << 20, "staging memory per sidecar pool (Mamba, SWA, DSA) on SGLang's default "
        "allocator; a pool whose page is larger is refused at attach (K, M, G suffixes)",
        sglang=True, size=True, lo=1)
    sidecar_checksum: bool = setting(
        True, "payload checksums on sidecar pools: written on every set, required on every "
        "get (a page without one or with a bad one is a miss); false: the engine's "
        "write_checksum / require_checksum", sglang=True)
    namespace: str = setting(
        "", "the key namespace's model identity, set by the operator: servers with the same "
        "value (and model name, ranks, geometry) share pages, whatever their weights; empty: "
        "the weights' identity (config and weight files of a local model directory, read 4 KiB "
        "of every MiB: any changed run of 1 MiB or more is another model; hub id and "
        "revision, served model name, weight version)", sglang=True)
    probe_wait_s: float = setting(0.1, "batch_exists waits up to this long for the workers' "
                                  "answers about keys the index does not know (pages other "
                                  "engines or nodes wrote); 0: answer from the index, later "
                                  "calls see what the workers found (until the store scan at "
                                  "start is whole, at least 0.5 s: decision 110)",
                                  sglang=True, lo=0)

    def __post_init__(self):
        for f in settings(type(self)):
            setattr(self, f.name, parse_value(f, getattr(self, f.name)))


def known_keys() -> frozenset:
    """Every extra-config key anyone reads: SGLang, this adapter, the engine."""
    return SGLANG_OWN_KEYS | settable_keys(AdapterConfig)


def storage_dir(extra: dict):
    """`storage_dir` as given, else SGLang's `file_storage_path`, else
    $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else DEFAULT_STORAGE_DIR. A
    `storage_dir` that is present is returned even when empty, for the caller
    to refuse (common.store_dirs): "" is a mistake, never "the default"; only
    an absent key (or null) means the default."""
    if extra.get("storage_dir") is not None:
        return extra["storage_dir"]
    return (extra.get("file_storage_path")
            or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or DEFAULT_STORAGE_DIR)
