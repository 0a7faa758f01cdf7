"""One TP rank of test_sglang_fastpath's two-rank case, as its own process.

argv: RANK WORLD PG_FILE STORE OUT_JSON VARIANTS PAGES_STORED
VARIANTS: stock, fast, or several in turn ("stock,fast"): one SGLang import
and one gloo group serve them all. Stock runs before install(), so a
"stock,fast" process is stock first exactly as a fresh process would be
(install() then replaces the controller's methods for the stacks built after
it, as in test_dense_same_as_stock); each variant has its own store
(STORE/VARIANT) and its own result file (OUT_JSON.VARIANT), written as soon
as that variant is done.

Joins a gloo group (torch.distributed, file:// rendezvous), builds SGLang's
real HiCacheController over hicache_mp with that group as its TP group (so
hit counts and acks are agreed across the ranks, MIN), backs up its first
PAGES_STORED pages, prefetches the whole sequence once, and writes what it
saw: the agreed hit, the completed tokens, the pages checked and wrong.
"""
import json
import os
import sys

import torch

from hicache_mp.bench.sglang import real as R
from hicache_mp.bench.sglang import stack as S

# 8 KiB pages of 4 tokens, 160 pages: two of SGLang's 128-page batches
DENSE = ["--round-mib", "1.25", "--page-mib", "0.0078125", "--layers", "2", "--heads", "4",
         "--head-dim", "64", "--requests", "1", "--workers", "1", "--timeout-s", "60"]


def run_variant(sgl, rank: int, world: int, store: str, variant: str, stored: int) -> dict:
    from hicache_mp.integrations.sglang import fastpath
    if variant == "fast":
        fastpath.install()
    else:
        assert variant == "stock" and not fastpath.installed(), variant
    args = S.parse(DENSE)
    s = S.Stack(sgl, "mp", args, store, tp_rank=rank, tp_size=world,
                tp_group=torch.distributed.group.WORLD)
    try:
        P = s.P
        _, written = S.backup(s.ctl, s.src[:stored * P], s.tokens[:stored * P],
                              s.hashes[:stored], S.Scheduler(False), 60)
        assert written == stored * P, written
        torch.distributed.barrier()          # every rank's pages are in before any asks
        _, done, idx = S.prefetch(s.ctl, s.hp, [(s.tokens, None)], S.Scheduler(False), 60)
        if idx[0] is not None:
            s.check(idx[0], done[0])
            s.hp.free(idx[0])
        res = {"done": done[0], "wrong": s.wrong_pages, "checked": s.checked_pages,
               "page_tokens": P}
    finally:
        s.close()
    torch.distributed.barrier()              # both ranks' stacks closed before the next
    return res


def main(argv) -> None:
    rank, world, pg, store, out, variants, stored = argv
    rank, world, stored = int(rank), int(world), int(stored)
    sgl = R.import_stack()
    torch.distributed.init_process_group("gloo", init_method=f"file://{pg}", rank=rank,
                                         world_size=world)
    for variant in variants.split(","):
        res = run_variant(sgl, rank, world, os.path.join(store, variant), variant, stored)
        with open(f"{out}.{variant}", "w") as f:
            json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
