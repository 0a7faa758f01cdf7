"""The old path of the engine's settings, kept for users who import
`EngineConfig`, `setting` and the rest from here. The module is
hicache_mp.engine.config; this name is that same module object.
"""
import sys

from .engine import config

sys.modules[__name__] = config
