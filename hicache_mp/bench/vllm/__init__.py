"""Rigs that drive vLLM's real tiering classes, for benches and tests.

Owns the vLLM tier bench (tier: vLLM's fs tier against hicache_mp's, one
CPU tier, vLLM's scheduler-step calls) and its capacity run (capacity). Must
not stand in for vLLM's classes, and is never imported by the engine or the
vLLM adapter (hicache_mp.integrations.vllm).
"""
