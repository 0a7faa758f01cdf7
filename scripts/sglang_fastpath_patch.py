#!/usr/bin/env python3
"""Writes (or with --check, compares) the upstream patch of the SGLang storage fast path.

The patch is made from the methods install() puts on SGLang's classes
(hicache_mp/integrations/sglang/fastpath_methods.py), written into the
installed SGLang 0.5.23's sources (fastpath.patch_text), so the patch and
install() cannot drift apart; tests/integrations/test_sglang_fastpath.py
runs the --check.

    python3 scripts/sglang_fastpath_patch.py           # rewrite the .patch
    python3 scripts/sglang_fastpath_patch.py --check   # exit 1 if it differs
"""
import argparse
import os
import sys
import sysconfig

from hicache_mp.integrations.sglang import fastpath

PATCH = os.path.join(os.path.dirname(fastpath.__file__), "upstream",
                     "sglang-0.5.23-hicache-fastpath.patch")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    ap.add_argument("--site-packages", default=sysconfig.get_paths()["purelib"],
                    help="where SGLang 0.5.23 is installed (stock)")
    args = ap.parse_args(argv)
    import sglang
    fastpath._check_version(getattr(sglang, "__version__", "unknown"))
    text = fastpath.patch_text(args.site_packages)
    if args.check:
        with open(PATCH) as f:
            same = f.read() == text
        print("the patch is what install() does" if same else f"{PATCH} is stale: rerun "
              f"without --check")
        return 0 if same else 1
    with open(PATCH, "w") as f:
        f.write(text)
    print(f"wrote {PATCH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
