"""The DeviceLoader: KV pages between the shared-memory host pool and the GPU KV cache.

    loader    DeviceLoader: the public calls, when to issue (step()), close
    buffers   the device K/V buffers, their views and the pool's, CUDA registration
    copies    one batch's copies either way; how bytes move per layout
    plan      runs of consecutive pages, the method per batch (no torch)
    handles   LoadHandle, StoreHandle: a caller's progress
    cuda      host registration, the pool's device mapping, the CPU stand-ins

Off the SGLang and vLLM paths (each framework moves its own device pages).
Imports the engine (hicache_mp.engine) and torch; the engine never imports
this package. The loader drives the engine (DeviceLoader.poll polls it,
then steps); the engine only calls the loader's close() first in its own
close() (engine.on_close), while the pool is still mapped.
"""
from .loader import DeviceLoader

__all__ = ["DeviceLoader"]
