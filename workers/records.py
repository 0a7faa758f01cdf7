"""Record kinds: what one ring record asks for or reports between the engine,
its workers, the evictor and the store scanner.

Owns the numbering of the `kind` field of shm.ring.RECORD_DTYPE (the ring
itself carries records of any kind). Must not hold any logic.
"""
KIND_READ = 1    # engine -> worker: read this page file into its host slot
KIND_WRITE = 2   # engine -> worker: write this host slot to its page file
KIND_EVICT = 3   # evictor -> engine: this page file was removed (digest; io_ns = its bytes)
KIND_PROBE = 4   # engine -> worker -> engine: is this page on disk? (status ok/miss; no bytes move)
KIND_SCAN = 5    # scanner -> engine: a page file the store scan listed (digest)
KIND_SCAN_END = 6  # scanner -> engine: the scan is whole (io_ns = pages listed,
                   # op_id = temp files of dead writers removed)
