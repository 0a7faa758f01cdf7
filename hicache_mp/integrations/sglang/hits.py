"""batch_exists_v2's hit policies: which prefixes of a hybrid model's pages can be restored.

Owns the answer of SGLang's v2 `batch_exists_v2` from what each pool holds,
following SGLang 0.5.23's `HiCacheFile.batch_exists_v2`: ALL_PAGES (every
page of the KV prefix), TRAILING_PAGES (the last N pages of a prefix; the
restorable prefixes are a set), and BLOCK_GROUPS (not decided by any 0.5.23
backend; here as its docstring says: the pages covered by the leading
complete groups of `group_pages` keys, `block_pages` pages per group,
reported as the pool's verdict, never gating the KV hit). Prefixes are
sorted spans of page counts, intersected pool by pool: the work is per run
of present pages, never per page or per prefix. Must not ask the store:
presence comes from the caller as one 0/1 byte per page.
"""
import enum

KV = "kv"
MAMBA = "mamba"
ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS = "all_pages", "trailing_pages", "block_groups"
# id(enum member) -> (member, value): an Enum's `.value` is a Python descriptor
# and its hash a Python method; SGLang hands the same few members every call,
# so each is looked up once and compared as a str from then on.
_VALUES: dict = {}


def pool_name(name) -> str:
    """PoolName enum or str -> its value ('mamba', 'swa', ...)."""
    hit = _VALUES.get(id(name))
    if hit is not None and hit[0] is name:
        return hit[1]
    value = str(getattr(name, "value", name))
    if isinstance(name, enum.Enum):
        _VALUES[id(name)] = (name, value)
    return value


policy_name = pool_name


def trailing_spans(has: bytes, trailing: int) -> list:
    """[(lo, hi)] of the prefixes p (1-based, inclusive) whose last
    min(trailing, p) pages are all present; `has` holds one 0/1 byte per page.
    One step per run of present pages (bytes.find, GIL held), never per page."""
    spans, n, s = [], len(has), has.find(1)
    while s != -1:
        e = has.find(0, s)
        e = n if e == -1 else e          # pages [s, e) are present
        lo = 1 if s == 0 else s + trailing
        if lo <= e:
            spans.append((lo, e))
        s = has.find(1, e) if e < n else -1
    return spans


def intersect(a: list, b: list) -> list:
    """Intersection of two sorted lists of disjoint inclusive spans."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def decide(keys: list, kv_pages: int, pool_transfers, has, result_cls):
    """SGLang's PoolTransferResult (`result_cls`) for `keys`, whose leading
    `kv_pages` have KV pages; `has(pool name, keys)` says which pages of a pool
    are stored (one 0/1 byte per key)."""
    hit_count: dict = {KV: kv_pages} if kv_pages else {}
    spans = [(1, kv_pages)] if kv_pages else []
    prefix = keys[:kv_pages]
    for t in pool_transfers or ():
        if not spans:
            break
        name, policy = pool_name(t.name), policy_name(t.hit_policy)
        if policy == BLOCK_GROUPS:
            boundary = _block_groups(t, name, keys, kv_pages, has)
            if boundary:
                hit_count[t.name] = boundary
            continue  # a verdict of its own; never gates the KV hit
        if policy == ALL_PAGES:
            first = has(name, prefix).find(0)
            boundary = kv_pages if first == -1 else first
            pool_spans = [(1, boundary)] if boundary else []
        elif policy == TRAILING_PAGES:
            trailing = max(1, len(t.keys) if t.keys else 1)
            pool_spans = trailing_spans(has(name, prefix), trailing)
            boundary = pool_spans[-1][1] if pool_spans else 0
        else:
            raise ValueError(f"hicache_mp: unsupported pool hit policy {t.hit_policy!r}")
        if boundary:
            hit_count[t.name] = boundary
        spans = intersect(spans, pool_spans)
    restorable = []
    for lo, hi in spans:
        restorable += range(lo, hi + 1)
    return result_cls(spans[-1][1] if spans else 0, hit_count, restorable)


def _block_groups(t, name, keys, kv_pages, has) -> int:
    group, block = int(t.group_pages or 0), int(t.block_pages or 0)
    if group <= 0 or block <= 0:
        raise ValueError(f"hicache_mp: BLOCK_GROUPS transfer {name!r} needs positive "
                         f"group_pages and block_pages, got {group} and {block}")
    gkeys = list(t.keys) if t.keys else keys[:kv_pages]
    full = len(gkeys) // group
    first = has(name, gkeys[:full * group]).find(0)
    groups = full if first == -1 else first // group
    return min(groups * block, kv_pages)
