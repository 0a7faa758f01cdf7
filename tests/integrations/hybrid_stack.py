"""SGLang's real hybrid host-pool classes for a test module, or the module skipped.

Owns the one way the v2 tests load them (hicache_mp/bench/sglang/real_hybrid.load) and
the skip message that says what to install. Must not build pools itself.
"""
import pytest

from hicache_mp.bench.sglang import real_hybrid as real


def load_or_skip():
    """The loaded classes; skips the calling test module where they do not import."""
    try:
        return real.load()
    except Exception as exc:  # ImportError, or a broken module on the chain
        pytest.skip(f"SGLang's host-pool classes cannot be imported here ({exc}); install "
                    f"`pip install --no-deps -r .ci/sglang-stack-requirements.txt`",
                    allow_module_level=True)
