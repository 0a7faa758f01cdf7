"""The stores a `storage_dir` spec can name, one registration line each.

Must hold nothing but registrations: workers.store.open_store reads them in
order, and a plain directory (workers.filestore.FileStore) is the fallback.
"""
from workers.store import register
from workers.stripestore import StripedStore

register(lambda spec: "," in spec, StripedStore)  # /nvme0/kv,/nvme1/kv: one directory per drive
