#!/usr/bin/env python3
"""Run scripts/bench_vllm_tier.py and list the files under ROOT it loaded.

Every module imported from ROOT (sys.modules) and every file opened in it
(an audit hook), one path per line relative to ROOT, into OUT: what a
stripped vLLM tree for the GPU box must keep. Used by device_vllm_wheels.sh
and device_before_after_wheels.sh; exits with the bench's own status.

    python3 scripts/device/trace_loaded.py ROOT OUT [--within vllm] -- --quick ...
"""
import argparse
import os
import runpy
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="the tree whose files are listed (e.g. a site-packages)")
    ap.add_argument("out", help="where the list goes")
    ap.add_argument("--within", default="", help="only files under ROOT/WITHIN (default: all)")
    ap.epilog = "Everything after -- goes to scripts/bench_vllm_tier.py."
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, bench = ap.parse_args(argv[:cut]), argv[cut + 1:]
    root = os.path.realpath(args.root)
    top = os.path.join(root, args.within) if args.within else root

    def under(p):
        return p.startswith(top + os.sep) and "__pycache__" not in p

    opened = set()

    def hook(event, hargs):
        if event == "open" and isinstance(hargs[0], str) and under(os.path.realpath(hargs[0])):
            opened.add(os.path.realpath(hargs[0]))

    sys.argv = ["scripts/bench_vllm_tier.py", *bench]
    sys.addaudithook(hook)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code or 0
    files = opened | {os.path.realpath(m.__file__) for m in list(sys.modules.values())
                      if getattr(m, "__file__", None) and under(os.path.realpath(m.__file__))}
    with open(args.out, "w") as fh:
        fh.write("".join(os.path.relpath(f, root) + "\n" for f in sorted(files)))
    print(f"trace: {len(files)} files loaded from {top}, rc {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
