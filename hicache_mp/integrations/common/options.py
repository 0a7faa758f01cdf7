"""A framework's dict of extra options, read the one way every adapter reads it.

Three kinds of key: the engine's settings (every EngineConfig field declared
with `setting(..., sglang=True)`: the flag was named for SGLang and means "an
adapter may set it"), the adapter's own (a dataclass declared the same way,
hicache_mp.engine.config.setting), and the framework's own keys (SGLang's loader
switches, vLLM's tier `type`/`locality`), which the adapter names. Every value
is parsed strictly by the field that declares it, so a bad value is a
ValueError naming its key, before any engine starts. A key none of them reads
is what `check_known` reports: SGLang's adapter warns (its dict is shared with
SGLang), vLLM's refuses (the dict is the tier's alone). `store_dirs` reads
`storage_dir` in every form a framework's config may hold it. Must not start
anything.
"""
import json
import os

from ...engine import config
from ...engine.config import EngineConfig, sglang_keys, sglang_options


def settable_keys(own_cls=None) -> frozenset:
    """Every key an adapter with own settings `own_cls` passes on or reads itself."""
    keys = sglang_keys()
    return keys | sglang_keys(own_cls) if own_cls is not None else keys


def own_settings(own_cls, extra: dict):
    """`own_cls` built from the keys of `extra` it declares (a None value keeps
    the default), each parsed by its declaration."""
    mine = sglang_keys(own_cls)
    return own_cls(**{k: v for k, v in extra.items() if k in mine and v is not None})


def check_known(extra: dict, known) -> list[str]:
    """The keys of `extra` nobody reads, sorted (empty when all are known)."""
    return sorted(set(extra) - set(known))


def engine_config(extra: dict, *, storage_dir: str, host_pool_pages: int, defaults=None,
                  **fixed) -> EngineConfig:
    """The EngineConfig for an adapter's engine: the engine settings present in
    `extra`, `defaults` for those absent (e.g. node_engines), and `fixed`, which
    the adapter decides and `extra` cannot set (the key namespace: model_name,
    tp_rank, tp_size, namespace_extra)."""
    options = sglang_options(extra)
    clash = sorted(set(options) & set(fixed))
    if clash:
        raise ValueError(f"extra options {clash} are set by the adapter itself")
    options["storage_dir"] = storage_dir
    for key, value in (defaults or {}).items():
        options.setdefault(key, value)
    # config.EngineConfig at call time, as sglang_options reads it: a program
    # that extends EngineConfig (a subclass put there) gets its settings here too
    return config.EngineConfig(host_pool_pages=host_pool_pages, **options, **fixed)


def store_dirs(value, *, log, who: str = "hicache_mp") -> str:
    """`storage_dir` as a framework's config holds it, as the engine's
    storage_dir: a directory, a comma-separated list of them, a list, or a
    JSON list in a string ("[...]": a string is all some front ends pass).
    A relative directory is resolved against the current directory here, once,
    and logged at INFO: the workers, the evictor and a later restart from
    elsewhere must all mean the same directory. ValueError, naming the key,
    for an empty value, a JSON string that is not a list of directories, or
    anything else."""
    given = value
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f'{who}: "storage_dir" {given!r} starts with "[" but is not a '
                             f"JSON list: {exc}") from None
        if not isinstance(value, list):
            raise ValueError(f'{who}: "storage_dir" {given!r} is not a JSON list')
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(d, str) and d.strip() for d in value):
            raise ValueError(f'{who}: "storage_dir" {given!r} must be a list of directory '
                             "names (non-empty strings)")
        dirs = [d.strip() for d in value]
    elif isinstance(value, str) and value.strip():
        dirs = [d.strip() for d in value.split(",")]
    else:
        raise ValueError(f'{who}: "storage_dir" must name a directory, a comma-separated '
                         f"list of them, or a list; got {given!r}")
    if not all(dirs):
        raise ValueError(f'{who}: "storage_dir" {given!r} has an empty entry')
    out, relative = [], []
    for d in dirs:
        full = os.path.expanduser(d)
        if not os.path.isabs(full):
            full = os.path.abspath(full)
            relative.append(f"{d!r} -> {full}")
        out.append(full)
    if relative:
        log.info('%s: relative "storage_dir" resolved against the current directory (%s): %s',
                 who, os.getcwd(), ", ".join(relative))
    return ",".join(out)
