"""Integrations of hicache_mp with inference servers.

`sglang/`: `HiCacheMP`, an SGLang HiCache L3 storage backend (loaded by
SGLang's `dynamic` backend factory), and `hicache-mp import-sglang`'s store
converter. `vllm/`: `HiCacheMPTier`, a vLLM KV-offloading secondary tier.
`common/`: what both adapters share (options, keys, slots, waits, stats,
mapping). Only `sglang.backend` imports SGLang and only `vllm/` imports vLLM,
so `import hicache_mp` needs neither. Each adapter stands on the engine
(hicache_mp.engine), never on the other adapter.
"""
