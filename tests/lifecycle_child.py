"""What test_lifecycle runs in a spawned child: torch-free (faultkit), so the
child imports numpy and the engine only, not torch (which the test module's
helpers import: seconds of the child's start and exit)."""
from faultkit import content, make, put


def engine_in_a_daemon(store, q) -> None:
    """An engine with a worker, one page backed up and found, from inside a
    daemonic process; puts True, or the error (never hangs the test)."""
    try:
        with make(store, pages=4, workers=1) as e:
            put(e, 0, content("d", e.geometry.page_bytes))
            q.put(e.wait(e.backup(["d"], [0]), 30) and e.exists(["d"]) == 1)
    except Exception as exc:
        q.put(repr(exc))
