"""Integrations of hicache_mp with inference servers.

`sglang`: `HiCacheMP`, an SGLang HiCache L3 storage backend (loaded by SGLang's
`dynamic` backend factory). It imports SGLang; nothing else here does, so
`import hicache_mp` never needs SGLang. `sglang_import` converts an SGLang
`file` store (`hicache-mp import-sglang`) with the SGLang-free helpers
`sglang_layouts` and `sglang_names`.
"""
