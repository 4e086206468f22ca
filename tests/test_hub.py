"""Model sources given as Hugging Face repo ids resolve through the local Hugging Face cache only: a fake cache laid
out as ``hf download`` leaves it (``models--Org--Name/snapshots/<commit>/`` and ``refs/main``), written
with jppo's own ``save_pretrained``; nothing is downloaded."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jppo.config import ConfigError, load_config
from jppo.models import CausalLM, ModelConfig, create_model, load_pretrained, save_pretrained

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tiny_model(hidden_size: int = 8) -> CausalLM:
    config = ModelConfig(vocab_size=14, hidden_size=hidden_size, intermediate_size=12, num_layers=1, num_heads=2,
                         num_kv_heads=1)
    return create_model(CausalLM, config, seed=0)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A Hugging Face hub cache in ``tmp_path/hub`` (via HF_HUB_CACHE) holding ``Org/Tiny``; returns its snapshot."""
    cache = tmp_path / "hub"
    repo = cache / "models--Org--Tiny"
    snapshot = repo / "snapshots" / COMMIT
    save_pretrained(tiny_model(), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: the lookup must not need the network anyway
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return snapshot


def params(model) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_a_cached_repo_id_resolves_to_its_snapshot_for_every_model_key_and_loads(hf_cache):
    keys = ("model.path", "model.tokenizer", "critic.model_path", "ref.model_path", "reward.model_path")
    cfg = load_config(None, [f"{key}=Org/Tiny" for key in keys])
    resolved = (cfg.model.path, cfg.model.tokenizer, cfg.critic.model_path, cfg.ref.model_path, cfg.reward.model_path)
    assert resolved == (str(hf_cache),) * len(keys)
    loaded = load_pretrained(cfg.model.path)
    for got, want in zip(params(loaded), params(tiny_model()), strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_uncached_repo_id_is_one_line_naming_key_id_cache_and_how_to_fetch(hf_cache):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["critic.model_path=Org/Missing"])
    message = str(error.value)
    assert "\n" not in message and message.startswith("critic.model_path='Org/Missing': ")
    assert "not in the local Hugging Face cache" in message and str(hf_cache.parents[2]) in message
    assert "hf download Org/Missing" in message


def test_an_existing_local_directory_wins_over_a_cached_repo_id(hf_cache):
    save_pretrained(tiny_model(hidden_size=4), "Org/Tiny")  # a local folder spelled like the repo id
    cfg = load_config(None, ["model.path=Org/Tiny"])
    assert cfg.model.path == "Org/Tiny"
    assert load_pretrained(cfg.model.path).config.hidden_size == 4


def test_a_local_checkpoint_path_is_kept_and_a_missing_one_still_reported(hf_cache, tmp_path):
    save_pretrained(tiny_model(), tmp_path / "ckpt")
    assert load_config(None, [f"model.path={tmp_path / 'ckpt'}"]).model.path == str(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"^model.path='/nonexistent/ckpt': no Hugging Face checkpoint"):
        load_config(None, ["model.path=/nonexistent/ckpt"])
