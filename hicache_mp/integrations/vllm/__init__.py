"""hicache_mp as a vLLM KV-offloading secondary tier: `HiCacheMPTier`.

    "secondary_tiers": [{"type": "HiCacheMPTier",
                         "module_path": "hicache_mp.integrations.vllm", ...}]

    tier     HiCacheMPTier: vLLM's calls as the engine's, its jobs (the
             configuration: tier.py's docstring, docs/vllm.md)
    api      vLLM's tiering API, imported once, and the version pin
    lookup   Lookups: vLLM's per-step lookups from the engine's index

The bool-mask steps on vLLM's scheduler thread are shm.gilkeep's (GIL kept).

Importing this package imports vLLM and checks its version (an ImportError
saying which releases are supported otherwise): vLLM's factory loads the
`module_path` and takes `HiCacheMPTier` from it. Must not import SGLang.
"""
from .tier import HiCacheMPTier

__all__ = ["HiCacheMPTier"]
