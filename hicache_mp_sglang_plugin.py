"""SGLang's general plugin `hicache_mp_fastpath`: the storage fast path, opted in.

Registered by `pip install hicache_mp` as an entry point in SGLang's group
`sglang.srt.plugins`. SGLang's `load_plugins()` calls `load()` early in
every process it starts (its launcher, each scheduler, the detokenizer, the
data-parallel controller), whatever the front end: HTTP, gRPC, Ray,
encoder-only. With `HICACHE_MP_FASTPATH=1` in the server's environment,
`load()` installs the fast path through SGLang's `HookRegistry`
(`fastpath.install_through_hooks()`), which SGLang applies once its plugins
have run. Without it, `load()` returns having done nothing: SGLang's classes
stay stock and nothing is imported. Another SGLang version, or an 0.5.23
whose replaced methods are not the stock ones, is one error in the log and
SGLang stays stock; the server runs on.

A module of its own, outside the `hicache_mp` package, because SGLang
imports it in every process of every server where hicache_mp is installed,
opted in or not, and importing `hicache_mp` loads the engine (numpy,
posix_ipc). Owns reading the opt-in; must import nothing at module level
but `os`, and must not change SGLang itself (fastpath does).
"""
import os

# Also fastpath.OPT_IN: the name is written twice because this module may not import it.
OPT_IN = "HICACHE_MP_FASTPATH"


def load() -> None:
    """The entry point SGLang's load_plugins() calls; never raises."""
    value = os.environ.get(OPT_IN, "")
    if value in ("", "0"):
        return
    import logging
    log = logging.getLogger("hicache_mp.sglang_plugin")
    if value != "1":
        log.error("hicache_mp: %s=%r is neither 1 (the SGLang storage fast path) nor 0 "
                  "(SGLang's stock path); SGLang keeps its stock storage path", OPT_IN, value)
        return
    fastpath = None
    try:
        from hicache_mp.integrations.sglang import fastpath
        changed = fastpath.install_through_hooks()
    except Exception as exc:   # noqa: BLE001 - the server must start, stock
        # A FastPathError (another version, non-stock methods) says what to
        # do; anything else (an import of SGLang's that fails) is named. Both
        # are raised before anything is changed or registered, so one line
        # is all there is to say, and the server runs on, stock.
        why = (str(exc) if fastpath is not None and isinstance(exc, fastpath.FastPathError)
               else f"{type(exc).__name__}: {exc}")
        log.error("hicache_mp: the SGLang storage fast path is not installed, SGLang keeps "
                  "its stock storage path: %s", why)
        return
    log.info("hicache_mp: SGLang storage fast path registered with SGLang's HookRegistry "
             "(%d changes, pid %d)", len(changed), os.getpid())
