"""`python3 -m hicache_mp`: the `hicache-mp` command (hicache_mp.cli), for an
install without the console script on PATH (pip's --user scripts directory, a
source checkout).

Owns nothing but the hand-over: argv parsing, the subcommands and their exit
statuses are hicache_mp.cli's. Must not run anything on import (the import
check loads every module): only as the program.
"""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
