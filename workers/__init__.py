"""I/O workers: the worker process, the pool that runs them, the page-file format and naming.

Owns everything that touches store files. Must not know about prefetch
policies, ops or the scheduler: it executes records and reports statuses.
"""
