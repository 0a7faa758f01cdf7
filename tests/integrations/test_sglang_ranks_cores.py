"""scripts/sglang_ranks.py counts the node's CPUs as the engines do
(hicache_mp.engine.cpubudget): a HICACHE_MP_NODE_CORES the engines refuse is
refused before any rank starts (test_sglang_stack runs the ranks)."""
import pytest

from hicache_mp.bench.sglang import real as sglang_real

try:
    sglang_real.import_stack()
except ImportError as exc:
    pytest.skip(f"SGLang's host-pool/controller chain is not importable ({exc}); install "
                f"`pip install --no-deps -r .ci/sglang-requirements.txt`", allow_module_level=True)

from hicache_mp.bench.sglang import ranks as sglang_ranks  # noqa: E402

ARGS = ["--ranks", "2", "--round-mib", "2", "--page-mib", "0.125", "--runs", "1"]


@pytest.mark.parametrize("value", ["\uff18", "0", "8 cores"])
def test_a_core_count_the_engines_refuse_is_refused_before_any_rank(monkeypatch, capsys,
                                                                    value):
    """A full-width digit (which int() takes: the bench counted 8 where every
    engine refused it), zero, words: exit status 2, naming the variable."""
    monkeypatch.setenv("HICACHE_MP_NODE_CORES", value)
    with pytest.raises(SystemExit) as exc:
        sglang_ranks.main(ARGS)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("sglang_ranks: HICACHE_MP_NODE_CORES=") and "e.g." in err
