"""Integrations of hicache_mp with inference servers.

`sglang/`: `HiCacheMP`, an SGLang HiCache L3 storage backend (loaded by
SGLang's `dynamic` backend factory), and `hicache-mp import-sglang`'s store
converter. `vllm`: `HiCacheMPTier`, a vLLM KV-offloading secondary tier.
`common/`: what both adapters share (options, keys, slots, waits, stats,
mapping). Only `sglang.backend` imports SGLang and only `vllm*` import vLLM,
so `import hicache_mp` needs neither.
"""
