"""Key digests are remembered per process, and that changes nothing a user sees:
the same digest (hence the same page file) as the formula, bad keys refused every
time, and the memory bounded.

Reaches inside: workers.naming's `_DIGESTS` (the per-process cache of
digests) and `_DIGESTS_MAX` (its bound): the memory bound is the cache's own
size, which no public call reports.
"""
import hashlib

import pytest

from workers import naming

NS = "model|tp0of1|00ff|"


def _formula(key: bytes) -> bytes:
    return hashlib.sha256(NS.encode() + b"\0" + key).digest()


def test_a_remembered_digest_is_the_formula_for_str_bytes_and_bytearray():
    for _ in range(2):  # computed, then remembered
        assert naming.key_digest("abc", NS) == _formula(b"abc")
        assert naming.key_digest(b"abc", NS) == _formula(b"abc")
        assert naming.key_digest(bytearray(b"abc"), NS) == _formula(b"abc")
    # another namespace is another page
    assert naming.key_digest("abc", NS + "x") != naming.key_digest("abc", NS)


@pytest.mark.parametrize("bad", ["a/b", "..", "", "x\0y", 7])
def test_a_bad_key_is_refused_every_time(bad):
    for _ in range(2):
        with pytest.raises(ValueError):
            naming.key_digest(bad, NS)


def test_the_memory_is_bounded():
    for i in range(naming._DIGESTS_MAX + 10):
        naming.key_digest(f"bound-{i}", NS)
    assert len(naming._DIGESTS) <= naming._DIGESTS_MAX
    assert naming.key_digest("bound-3", NS) == _formula(b"bound-3")
