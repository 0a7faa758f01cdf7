"""`hicache-mp sglang-serve -- <launch_server args>`: an alias of
`HICACHE_MP_FASTPATH=1 python -m sglang.launch_server <args>` (decision 103).

The fast path reaches SGLang's processes through its plugin loader: the
`hicache_mp_fastpath` plugin (hicache_mp_sglang_plugin) installs it in every
process SGLang loads plugins in, so every front end SGLang has (HTTP, gRPC,
Ray, encoder-only) gets it. This command only sets the opt-in and replaces
itself with SGLang's own launcher. It first checks what would make the
opt-in silently do nothing: the plugin not registered (hicache_mp run from
a checkout, not `pip install`ed) or left out by SGLANG_PLUGINS.

Owns the alias and nothing else; must not import SGLang (the CLI's --help
loads it without SGLang) or change SGLang's server args.
"""
from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

PLUGIN = "hicache_mp_fastpath"
PLUGIN_GROUP = "sglang.srt.plugins"   # SGLang's general plugins (GENERAL_PLUGINS_GROUP)
OPT_IN = "HICACHE_MP_FASTPATH"        # fastpath.OPT_IN, without importing fastpath's deps


def command(server_argv: list[str]) -> list[str]:
    """The command this alias runs: SGLang's launcher with `server_argv`."""
    return [sys.executable, "-m", "sglang.launch_server", *server_argv]


def plugin_problem(environ=os.environ) -> str | None:
    """Why SGLang would not load the plugin in a server started with `environ`, or None."""
    if not any(ep.name == PLUGIN for ep in entry_points(group=PLUGIN_GROUP)):
        return (f"SGLang's plugin {PLUGIN} is not registered in this Python ({sys.executable}): "
                f"install hicache_mp with pip (pip install -e . in a checkout)")
    allowed = environ.get("SGLANG_PLUGINS", "")
    if allowed and PLUGIN not in {x.strip() for x in allowed.split(",")}:
        return f"SGLANG_PLUGINS={allowed!r} leaves out {PLUGIN}: add it to the list"
    return None


def main(server_argv: list[str]) -> int:
    """Replace this process with SGLang's launcher, opted in; 2 where the plugin would not load."""
    problem = plugin_problem()
    if problem:
        print(f"hicache-mp sglang-serve: {problem}", file=sys.stderr)
        return 2
    argv = command(server_argv)
    print(f"hicache-mp sglang-serve: {OPT_IN}=1 {' '.join(argv[1:])}", file=sys.stderr,
          flush=True)
    os.environ[OPT_IN] = "1"
    os.execv(argv[0], argv)
    return 0   # not reached: execv replaces the process
