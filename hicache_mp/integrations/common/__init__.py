"""What every framework adapter needs and no framework defines (SGLang's, vLLM's).

    options   a framework's dict of extra options -> the adapter's own settings,
              the engine's EngineConfig, the keys nobody reads, storage_dir
    keys      framework keys -> engine keys (bytes as hex), leading-run answers
    slots     free slots of a staging pool (take / try_take / give)
    waits     wait for an op, abandon it past a timeout
    stats     per-adapter counters and per-call figures
    mapping   which shared file backs a buffer, for zero-copy pools
    identity  what identifies a model's weights in the key namespace

Must not import a framework, start an engine on its own, or move page bytes.
"""
from .identity import model_identity
from .keys import engine_key, engine_keys, leading
from .mapping import FileRegion, RegionNotShared, file_region, open_region
from .options import check_known, engine_config, own_settings, settable_keys, store_dirs
from .slots import Slots
from .stats import CallStats
from .waits import wait_or_abandon

__all__ = ["engine_key", "engine_keys", "leading", "FileRegion", "RegionNotShared",
           "file_region", "open_region", "check_known", "engine_config", "own_settings",
           "settable_keys", "store_dirs", "Slots", "CallStats", "wait_or_abandon", "model_identity"]
