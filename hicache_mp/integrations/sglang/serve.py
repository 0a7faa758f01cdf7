"""`hicache-mp sglang-serve -- <launch_server args>`: SGLang's HTTP server with
the storage fast path (fastpath.install()) in every scheduler process.

SGLang starts its scheduler processes with the `spawn` start method, so a
patch made in the launcher's process does not reach the processes that
build the cache controller. SGLang's `launch_server` takes the scheduler
process's entry as an argument (`run_scheduler_process_func`, there for
private forks); `run_scheduler_process` below is that entry: it installs the
fast path in the new process, then runs SGLang's own. It is a module-level
function, so `spawn` pickles it by name and the child imports this module.

`main()` does what `python -m sglang.launch_server` does (plugins, server
args, then the server) with that entry, after install() in the launcher
itself, so a wrong SGLang version is refused before anything starts. Only
SGLang's default HTTP server is launched this way: the gRPC, encoder-only
and Ray front ends are refused with a pointer to the upstream patch.

Owns the launch and nothing else; must not change SGLang's server args or
import SGLang at module level (the CLI's --help loads it without SGLang).
"""
from __future__ import annotations

import os
import sys

from . import fastpath


def run_scheduler_process(*args, **kwargs):
    """SGLang's scheduler process entry, with the fast path installed first."""
    fastpath.install()
    from sglang.srt.managers.scheduler import run_scheduler_process as stock
    return stock(*args, **kwargs)


def main(server_argv: list[str], *, version: str | None = None) -> int:
    """Start SGLang's server with `server_argv` (launch_server's arguments).
    `version` stands for sglang.__version__ (tests fake it)."""
    try:
        changed = fastpath.install(version=version)
    except fastpath.FastPathVersionError as exc:
        print(f"hicache-mp sglang-serve: {exc}", file=sys.stderr)
        return 2
    print(f"hicache-mp sglang-serve: SGLang storage fast path installed "
          f"({len(changed)} methods; each scheduler process installs it too)", file=sys.stderr)
    from sglang.launch_server import load_plugins, prepare_server_args
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(server_argv)
    server_args.resolve_once()
    cfg = resolving_view(server_args)
    if cfg.encoder_only or cfg.smg_grpc_mode or cfg.use_ray:
        print("hicache-mp sglang-serve: only SGLang's HTTP server is launched with the fast "
              "path; for gRPC, encoder-only or Ray, apply "
              "hicache_mp/integrations/sglang/upstream/sglang-0.5.23-hicache-fastpath.patch "
              "to SGLang instead", file=sys.stderr)
        return 2
    from sglang.srt.entrypoints.http_server import launch_server  # the server's own deps
    try:
        launch_server(server_args, run_scheduler_process_func=run_scheduler_process)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
