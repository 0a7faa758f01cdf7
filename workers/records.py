"""Record kinds: what one ring record asks for or reports between the engine,
its workers and the evictor.

Owns the numbering of the `kind` field of shm.ring.RECORD_DTYPE (the ring
itself carries records of any kind). Must not hold any logic.
"""
KIND_READ = 1    # engine -> worker: read this page file into its host slot
KIND_WRITE = 2   # engine -> worker: write this host slot to its page file
KIND_EVICT = 3   # evictor -> engine: this page file was removed (digest; io_ns = its bytes)
KIND_PROBE = 4   # engine -> worker -> engine: is this page on disk? (status ok/miss; no bytes move)
