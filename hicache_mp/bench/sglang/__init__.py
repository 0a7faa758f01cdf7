"""Rigs that drive SGLang's real classes outside a server, for benches and tests.

Owns: loading SGLang's host pools and HiCacheController where a full server
cannot run (real, real_hybrid, hybrid_controller), the backends that move no
bytes (nobytes: SGLang's own floor), and the harnesses that measure hicache_mp
behind them (stack, ranks, hybrid_check, hybrid_rank). Must not stand in for
anything on the storage path, and is never imported by the engine or the
SGLang adapter (hicache_mp.integrations.sglang).
"""
