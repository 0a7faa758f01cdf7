"""Discovery finds a whole prefix another engine wrote in one exists() call.

SGLang's hit query stops at the first short answer, and a hybrid model's
trailing-page rule needs the prefix's last page: a prefix another engine wrote
must be found whole by one `exists(keys, wait_s=...)`, not a slice per call.
"""
import time

from hicache_mp.discovery import PROBE_TTL_S
from helpers import engine, fill, random_pages, read_back

PAGES = 300   # longer than SGLang's 128-page storage batch and than any small probe cap


def test_one_exists_call_finds_a_whole_prefix_another_engine_wrote(store):
    keys = [f"prefix-{i}" for i in range(PAGES)]
    with engine(store, pages=PAGES) as reader:     # running before the pages exist
        assert reader.exists(keys) == 0
        with engine(store, pages=PAGES) as writer:
            data = random_pages(writer.geometry, PAGES, seed=7)
            fill(writer, range(PAGES), data)
            op = writer.backup(keys, range(PAGES))
            assert writer.wait(op, 60) and op.status == "ok", op
        # Past the negative cache of the reader's first call, ONE call finds them all.
        time.sleep(PROBE_TTL_S + 0.05)
        assert reader.exists(keys, wait_s=10.0) == PAGES
        op = reader.prefetch(keys, range(PAGES))
        assert reader.wait(op, 60) and op.status == "ok", op
        assert (read_back(reader, range(PAGES)) == data).all()
