"""Model identity through vLLM's real tiering classes (decision 91): two models
served from one path never share the tier's pages.

vLLM names a model by its path; a container serving `/model` names every model
`/model`. The tier's namespace carries the weights' identity (config.json and
sampled weight files), so a second model at the same path misses cleanly and
the first model's pages are found again when its weights come back.
"""
import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed; install it with "
                "`pip install --no-deps -r .ci/vllm-requirements.txt`", allow_module_level=True)

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from vllm_tiers import OURS, fill, finish, job, key, resolve, rows_of, tiering  # noqa: E402

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def weights(path, seed: int) -> None:
    """A model directory: its config and one weight file of `seed`'s bytes."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"model_type": "llama", "num_hidden_layers": 2}')
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(bytes([seed]) * (256 << 10))


def test_two_models_at_one_path_share_no_pages(store, tmp_path):
    model = str(tmp_path / "model")
    cfg = {**OURS, "storage_dir": store, "num_workers": 2}
    keys = [key(900 + i) for i in range(4)]
    weights(model, seed=1)
    with tiering([cfg], model=model) as (_, manager):
        tier = manager.secondary_tiers[0]
        fill(rows_of(tier), range(4), seed=9)
        tier.submit_store(job(1, keys, range(4), load=False))
        assert finish(tier, [1])[1].success
        assert resolve(tier, keys) == [HIT] * 4
    weights(model, seed=2)          # another fine-tune, served from the same path
    with tiering([cfg], model=model) as (_, manager):
        assert resolve(manager.secondary_tiers[0], keys) == [MISS] * 4
    weights(model, seed=1)          # the first model again: its pages are found
    with tiering([cfg], model=model) as (_, manager):
        assert resolve(manager.secondary_tiers[0], keys) == [HIT] * 4
