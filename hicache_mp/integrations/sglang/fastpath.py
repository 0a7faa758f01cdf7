"""The HiCache storage fast path, applied to SGLang's classes in this process.

`install()` puts the methods of `fastpath_methods` on SGLang 0.5.23's
`HiCacheController` and `HybridCacheController`, and the default of the one
method it asks backends (`hit_query_at_once`) on `HiCacheStorage` (see that
module for what changes and why) and returns what it changed.
`install_through_hooks()` makes the same change through SGLang's plugin
framework (REPLACE hooks registered with its `HookRegistry`): it is what the
`hicache_mp_fastpath` plugin (the top-level hicache_mp_sglang_plugin module)
calls in every process SGLang loads plugins in (decision 108).
`uninstall()` puts SGLang's own methods back after either, and refuses
(`FastPathInUse`, nothing changed) while a cache controller still runs
storage threads started under the fast path: their loops call the fast
path's methods and names, which uninstall() removes. `patched_source()`
writes the same methods into SGLang's source text, which is how the
upstream patch in upstream/ is made (scripts/sglang_fastpath_patch.py) and
checked (tests/integrations/).

Only the version it was built and tested against is patched: any other
SGLang raises `FastPathVersionError`, because the methods replaced are
copies of that version's with a few lines changed, and on another version
they would silently undo its fixes.

Owns the patching of those three classes and nothing else; must not import
SGLang at module level (its checks come first, so another SGLang is refused
before any of its modules is imported for it), touch an engine, or change
any other SGLang class.
"""
from __future__ import annotations

import ast
import difflib
import gc
import hashlib
import importlib
import inspect
import logging
import os
import textwrap
import threading
import types
import weakref

from . import fastpath_methods

SGLANG_VERSION = "0.5.23"
# The opt-in the plugin reads (decision 103); hicache_mp_sglang_plugin holds the same name,
# since that module may import nothing of hicache_mp's before it is set.
OPT_IN = "HICACHE_MP_FASTPATH"

# SGLang 0.5.23's own source of every method the fast path replaces (sha256,
# first 16 hex digits): an 0.5.23 whose methods differ (a vendor build, a
# local patch, the upstream patch already applied) is refused too, because
# install() would silently replace whatever they changed.
STOCK_SOURCES = {
    "HiCacheController._start_storage_threads": "b005fdc04d7ea7f1",
    "HiCacheController.prefetch": "c208351097b07acc",
    "HiCacheController.prefetch_thread_func": "6296cd9aa0b38266",
    "HiCacheController._storage_hit_query": "5352def1560a362a",
    "HybridCacheController.prefetch": "4a96706426d1c0f9",
    "HybridCacheController._storage_hit_query": "5ca6e010ea7fceb1",
    "HiCacheController._page_transfer": "bef387703701bb7f",
    "HiCacheController.prefetch_io_aux_func": "a731bbb0fdaff18c",
    "HiCacheController.prefetch_sync_thread_func": "41e792c07ea6b8bb",
    "HiCacheController._sync_prefetch_hit_query": "02158a47034873a4",
    "HiCacheController._reduce_prefetch_ack": "89a404828dd9dd9d",
    "HybridCacheController._page_transfer_sidecar": "70f648dfe5480416",
    "HybridCacheController._sync_prefetch_hit_query": "c6f4b7588d92233b",
    "HybridCacheController._reduce_prefetch_ack": "bad6383983cb7a3e",
    "HybridCacheController.prefetch_sync_thread_func": "b1bd6c3a6f8a9478",
}

# What install() changed, for uninstall(): (class, name, SGLang's own or None).
_INSTALLED: list[tuple[type, str, object]] = []
# The threads alive when install() applied the fast path: a controller's
# storage thread not among them was started under it (its loop is a fast-path
# method). Weak: a thread that ends is no business of ours.
_THREADS_BEFORE: weakref.WeakSet = weakref.WeakSet()
# The controller attributes SGLang keeps its storage threads in (0.5.23).
STORAGE_THREADS = ("prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread",
                   "backup_thread")


class FastPathError(RuntimeError):
    """The fast path cannot be installed or uninstalled now; nothing was changed."""


class FastPathVersionError(FastPathError):
    """The running SGLang is not the version the fast path was built and tested for."""


class FastPathInUse(FastPathError):
    """uninstall() while a controller runs storage threads started under the fast path."""


def _check_version(version: str | None = None) -> str:
    if version is None:
        import sglang  # the one optional import here: install() needs SGLang
        version = getattr(sglang, "__version__", "unknown")
    if version != SGLANG_VERSION:
        raise FastPathVersionError(
            f"hicache_mp's SGLang storage fast path is built and tested for SGLang "
            f"{SGLANG_VERSION} only; this is SGLang {version}. Run SGLang {SGLANG_VERSION}, "
            f"or start the server without the fast path (no {OPT_IN}=1).")
    return version


def _methods(holder: type) -> dict[str, types.FunctionType]:
    return {n: f for n, f in vars(holder).items() if isinstance(f, types.FunctionType)}


def _bound_to(fn: types.FunctionType, module: types.ModuleType, cls: type):
    """`fn` as if defined in `cls` of `module`: its globals are the module's
    and a zero-argument super() sees `cls` (its __class__ cell)."""
    closure = None
    if fn.__code__.co_freevars:
        if fn.__code__.co_freevars != ("__class__",):
            raise TypeError(f"{fn.__qualname__} closes over {fn.__code__.co_freevars}")
        closure = (types.CellType(cls),)
    new = types.FunctionType(fn.__code__, module.__dict__, fn.__name__, fn.__defaults__,
                             closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__doc__ = fn.__doc__
    new.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
    new.__module__ = module.__name__
    new.__annotations__ = dict(fn.__annotations__)
    return new


def _source_digest(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def installed() -> bool:
    return bool(_INSTALLED)


def _plan(version: str | None) -> list[tuple]:
    """What install() would change, as (module, class or module, name, fn, SGLang's own or
    None); FastPathVersionError, with nothing changed, for another SGLang or an 0.5.23
    whose replaced methods are not the stock ones."""
    _check_version(version)
    plan = []
    for mod_name, cls, _before in fastpath_methods.CLASSES:
        module = importlib.import_module(mod_name)
        if hasattr(module, cls.__name__):
            raise FastPathVersionError(
                f"this SGLang {SGLANG_VERSION}'s {mod_name} already has a {cls.__name__} (a "
                f"different build, or the upstream patch already applied, which makes "
                f"install() unnecessary); nothing was changed")
        plan.append((module, module, cls.__name__, cls, None))
    for mod_name, cls_name, holder, _anchor in fastpath_methods.TARGETS:
        module = importlib.import_module(mod_name)
        cls = getattr(module, cls_name)
        for name, fn in _methods(holder).items():
            old = vars(cls).get(name)
            want = STOCK_SOURCES.get(f"{cls_name}.{name}")
            if (want is None) != (old is None) or (old is not None and
                                                  _source_digest(old) != want):
                raise FastPathVersionError(
                    f"this SGLang {SGLANG_VERSION}'s {cls_name}.{name} is not the one the fast "
                    f"path was built from (a different build, a local patch, or the upstream "
                    f"patch already applied, which makes install() unnecessary); "
                    f"nothing was changed")
            plan.append((module, cls, name, fn, old))
    return plan


def _apply(plan: list[tuple], replace) -> list[str]:
    """Put `plan` in: names SGLang lacks are set here, and each of SGLang's own
    methods is handed to `replace(cls, name, fn)`."""
    changed = []
    _THREADS_BEFORE.clear()
    _THREADS_BEFORE.update(threading.enumerate())
    for module, cls, name, fn, old in plan:
        if cls is module:   # a class of the module's own (fastpath_methods.CLASSES)
            setattr(module, name, fn)
            _INSTALLED.append((module, name, None))
            changed.append(f"added {module.__name__}.{name}")
            continue
        bound = _bound_to(fn, module, cls)
        if old is None:
            setattr(cls, name, bound)
        else:
            replace(cls, name, bound)
        _INSTALLED.append((cls, name, old))
        changed.append(f"{'replaced' if old is not None else 'added'} "
                       f"{module.__name__}.{cls.__name__}.{name}")
    return changed


def install(*, version: str | None = None) -> list[str]:
    """Apply the fast path to SGLang's classes in this process; returns what
    changed ("replaced module.Class.method" / "added ..."). Idempotent: a
    second call changes nothing and returns []. `version` stands for
    sglang.__version__ (tests fake it to see the refusal).

    Call it before the server builds its cache controller: a controller whose
    threads already run keeps its sync thread, which then only idles."""
    _check_version(version)
    if _INSTALLED:
        return []
    return _apply(_plan(version), setattr)


def install_through_hooks(*, version: str | None = None) -> list[str]:
    """install() made through SGLang's plugin framework, for a general plugin
    to call inside `load_plugins()`: the same checks (FastPathVersionError,
    nothing changed), and each method SGLang has is registered as a REPLACE
    hook with `HookRegistry`, which SGLang applies when its plugins have run
    and logs with the plugin's and distribution's names. A hook can only wrap
    what exists, so the names SGLang lacks (the new methods and classes) are
    put in here. An AFTER hook on `HiCacheController.__init__` logs, in the
    scheduler's own log, each cache controller built with the fast path.

    Idempotent like install(); uninstall() undoes it too (it puts SGLang's
    own methods back over the hooks' wrappers)."""
    _check_version(version)
    if _INSTALLED:
        return []
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    plan = _plan(version)

    def replace(cls, name, fn):
        HookRegistry.register(f"{cls.__module__}.{cls.__qualname__}.{name}", fn,
                              HookType.REPLACE)
    changed = _apply(plan, replace)
    controller = importlib.import_module("sglang.srt.managers.cache_controller").HiCacheController
    _INSTALLED.append((controller, "__init__", vars(controller)["__init__"]))
    HookRegistry.register(f"{controller.__module__}.HiCacheController.__init__", _log_built,
                          HookType.AFTER)
    return changed


def _log_built(_result, controller, *args, **kwargs) -> None:
    # At plugin time SGLang has not configured logging yet (its scheduler
    # process loads plugins first), so this is the line a user sees.
    logging.getLogger(__name__).info(
        "hicache_mp: %s built with the SGLang storage fast path (%s=1)",
        type(controller).__name__, OPT_IN)


def running_under_fast_path() -> list[str]:
    """The storage threads, as "Class.attribute", of live cache controllers
    that were started under the fast path and still run."""
    if not _INSTALLED:
        return []
    controllers = tuple(getattr(importlib.import_module(mod), name)
                        for mod, name, _, _ in fastpath_methods.TARGETS
                        if name.endswith("CacheController"))
    out = []
    # SGLang keeps no registry of its controllers, and one built before
    # install() would be missed by any hook install() could add: the
    # collector's objects are every controller there is. uninstall() is rare.
    for obj in gc.get_objects():
        if not issubclass(type(obj), controllers):  # type(): no __class__ property runs
            continue
        for attr in STORAGE_THREADS:
            thread = vars(obj).get(attr)
            if isinstance(thread, threading.Thread) and thread.is_alive() \
                    and thread not in _THREADS_BEFORE:
                out.append(f"{type(obj).__name__}.{attr}")
    return out


def uninstall() -> list[str]:
    """Put SGLang's own methods back; returns what was restored.

    FastPathInUse, with nothing changed, while a cache controller runs storage
    threads started under the fast path: their loops are the fast path's
    methods and would meet NameErrors and stock methods mid-prefetch (a
    prefetch would hang)."""
    busy = running_under_fast_path()
    if busy:
        raise FastPathInUse(
            f"cannot uninstall hicache_mp's SGLang fast path: a cache controller built "
            f"under it still runs its storage threads ({', '.join(sorted(set(busy)))}), whose "
            f"loops are the fast path's methods. Stop them first (the controller's "
            f"detach_storage_backend(), i.e. SGLang's detach of the storage backend, or shut "
            f"the server down), or restart the process without the fast path; nothing was "
            f"changed")
    out = []
    while _INSTALLED:
        cls, name, old = _INSTALLED.pop()
        if old is None:
            delattr(cls, name)
        else:
            setattr(cls, name, old)
        if isinstance(cls, types.ModuleType):
            out.append(f"{cls.__name__}.{name}")
        else:
            out.append(f"{cls.__module__}.{cls.__name__}.{name}")
    return out


# --- the same change as source text (the upstream patch) ---------------------------
def _method_source(fn: types.FunctionType, indent: str) -> list[str]:
    return textwrap.indent(textwrap.dedent(inspect.getsource(fn)), indent).splitlines(True)


def patched_source(text: str, cls_name: str, holder: type, anchor: str) -> str:
    """SGLang's file `text` with `cls_name`'s methods named in `holder` replaced
    by the holder's, and the holder's new ones put after method `anchor`."""
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    defs = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    lines = text.splitlines(True)
    indent = " " * defs[anchor].col_offset
    methods = _methods(holder)
    new = [fn for name, fn in methods.items() if name not in defs]
    edits = []   # (first line, last line (exclusive), replacement), 0-based
    for name, fn in methods.items():
        if name in defs:
            node = defs[name]
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            edits.append((first, node.end_lineno, _method_source(fn, indent)))
    if new:
        at = defs[anchor].end_lineno
        body = []
        for fn in new:
            body += ["\n"] + _method_source(fn, indent)
        edits.append((at, at, body))
    for first, last, repl in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[first:last] = repl
    return "".join(lines)


def with_class(text: str, cls: type, before: str) -> str:
    """SGLang's file `text` with `cls`'s source put before its class `before`."""
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == before)
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    lines = text.splitlines(True)
    lines[first:first] = inspect.getsource(cls).splitlines(True) + ["\n", "\n"]
    return "".join(lines)


def patched_module(text: str, mod_name: str) -> str:
    """SGLang module `mod_name`'s source `text` as install() makes it behave:
    the fast path's classes put in (CLASSES), then its methods (TARGETS)."""
    for mod, cls, before in fastpath_methods.CLASSES:
        if mod == mod_name:
            text = with_class(text, cls, before)
    for mod, cls_name, holder, anchor in fastpath_methods.TARGETS:
        if mod == mod_name:
            text = patched_source(text, cls_name, holder, anchor)
    return text


def patched_modules() -> list[str]:
    """The SGLang modules the fast path changes, in the patch's order."""
    return list(dict.fromkeys(m for m, *_ in fastpath_methods.TARGETS))


def patch_text(site_packages: str) -> str:
    """The unified diff (paths a/sglang/..., b/sglang/...; apply with -p1 in
    site-packages) that makes SGLang's sources under `site_packages` read as
    install() makes its classes behave."""
    out = []
    for mod_name in patched_modules():
        rel = mod_name.replace(".", "/") + ".py"
        with open(os.path.join(site_packages, rel)) as f:
            old = f.read()
        new = patched_module(old, mod_name)
        out += difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                    f"a/{rel}", f"b/{rel}")
    return "".join(out)
