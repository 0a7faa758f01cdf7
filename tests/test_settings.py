"""Settings are declared once (hicache_mp.engine.config) and parsed strictly.

A setting added as one field of EngineConfig shows up in `hicache-mp bench
--help`, in the parsed command line, in EngineConfig and, through SGLang's
real storage factory, in the SGLang adapter's extra config.

The SGLang adapter's settings are read through its `config_for` (the
EngineConfig it would start its engine with, from its extra config), without
a host pool and workers, which register_mem_pool_host() would start.
"""
import logging
from dataclasses import dataclass

import pytest

from hicache_mp import cli
from hicache_mp.engine import config
from hicache_mp.engine.config import EngineConfig, setting


@dataclass
class WithOneMore(EngineConfig):
    frobnicate_pages: int = setting(3, "pages to frobnicate per round (test setting)",
                                    flag="--hicache-mp-frobnicate-pages", sglang=True, lo=0)


def test_a_setting_declared_once_reaches_help_flags_config_and_sglang(monkeypatch, capsys,
                                                                      store, caplog):
    monkeypatch.setattr(config, "EngineConfig", WithOneMore)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--hicache-mp-frobnicate-pages" in text
    assert "pages to frobnicate per round (test setting) (default: 3)" in text

    args = cli.build_parser().parse_args(["bench", "--hicache-mp-frobnicate-pages", "5"])
    options = cli.bench_config(args).engine_options
    assert options["frobnicate_pages"] == 5
    assert WithOneMore(storage_dir=store, **options).frobnicate_pages == 5
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--hicache-mp-frobnicate-pages", "-1"])

    sglang = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from hicache_mp.integrations.sglang import HiCacheMP
    caplog.set_level(logging.WARNING, logger="hicache_mp")
    backend = HiCacheMP(sglang.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="m", extra_config={"storage_dir": store, "frobnicate_pages": "7"}))
    assert not [r for r in caplog.records if "not used by hicache_mp" in r.getMessage()]
    cfg = backend.config_for(4)
    assert type(cfg) is WithOneMore and cfg.frobnicate_pages == 7


@pytest.mark.parametrize("text, want", [("true", True), ("False", False), ("0", False),
                                        ("1", True), ("yes", True), ("no", False),
                                        ("on", True), ("OFF", False), (True, True), (0, False)])
def test_booleans_parse_only_from_known_words(store, text, want):
    assert EngineConfig(storage_dir=store, write_checksum=text).write_checksum is want


@pytest.mark.parametrize("bad", ["maybe", "", "2", 2, 1.0, None, []])
def test_anything_else_is_not_a_boolean(store, bad):
    with pytest.raises(ValueError, match="write_checksum"):
        EngineConfig(storage_dir=store, write_checksum=bad)


@pytest.mark.parametrize("field, value, want", [
    ("storage_max_bytes", "500G", 500 << 30), ("storage_max_bytes", "1.5T", int(1.5 * (1 << 40))),
    ("storage_min_free_bytes", "64MiB", 64 << 20), ("storage_max_bytes", "1048576", 1 << 20),
    ("num_workers", "3", 3), ("eviction_interval_s", "0.5", 0.5)])
def test_sizes_and_numbers_from_strings(store, field, value, want):
    assert getattr(EngineConfig(storage_dir=store, **{field: value}), field) == want


@pytest.mark.parametrize("field, value", [
    ("storage_max_bytes", "lots"), ("storage_max_bytes", "-1G"), ("storage_max_bytes", 1.5),
    ("num_workers", True), ("num_workers", 2.0), ("io_depth", "2.5"),
    ("eviction_interval_s", 0), ("eviction_interval_s", float("inf")),
    ("prefetch_timeout_s", float("nan")), ("fsync", "sometimes"), ("direct_io", True),
    ("write_share", 0), ("write_share", 1), ("write_share", "1.5"), ("write_share", -0.1)])
def test_bad_values_name_their_field(store, field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(storage_dir=store, **{field: value})


def test_flags_and_sglang_keys_cover_the_old_ones():
    """Every flag and extra-config key of the five-place era is still there, by name."""
    flags = {f.metadata["setting"].flag for f in config.settings()} - {None}
    assert flags >= {"--hicache-mp-direct-io", "--hicache-mp-io-depth", "--hicache-mp-fsync",
                     "--hicache-mp-backup-budget-pages", "--storage-max-bytes",
                     "--storage-min-free-bytes", "--hicache-mp-workers",
                     "--hicache-storage-prefetch-policy", "--prefetch-timeout-s"}
    assert config.sglang_keys() >= {
        "storage_dir", "num_workers", "write_checksum", "verify_checksum", "pin_workers",
        "rescan_interval_s", "direct_io", "io_depth", "fsync", "backup_budget_pages",
        "storage_max_bytes", "storage_min_free_bytes", "write_share", "eviction_interval_s",
        "quarantine_bad_files"}


def _flags_reference() -> str:
    import os
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "docs", "flags.md")) as f:
        return f.read()


def test_the_flags_reference_lists_every_flag_and_extra_config_key():
    """The one declaration also reaches the documentation (docs/flags.md, generated
    by hicache_mp.flagsdoc): a flag or key missing there fails here."""
    text = _flags_reference()
    for f in config.settings():
        flag = f.metadata["setting"].flag
        if flag:
            assert f"`{flag}`" in text, f"docs/flags.md lacks {flag}"
    adapter = pytest.importorskip("hicache_mp.integrations.sglang")
    for key in config.sglang_keys() | config.sglang_keys(adapter.AdapterConfig):
        assert f"| `{key}` |" in text, f"docs/flags.md lacks the extra-config key {key}"
