"""From scores to the rewards, KL penalty and advantages the engine trains on."""

import functools
import json
import pathlib

import numpy as np
import pytest
import tokenizers

from jppo.advantages.estimate import compute_advantages
from jppo.config import load_config
from jppo.config.views import sampling_params
from jppo.core.experience import Experience
from jppo.data import CharTokenizer, Example, get_task, load_tokenizer
from jppo.parallel.hostlocal import on_mesh
from jppo.parallel.mesh import make_mesh
from jppo.rewards.kl_penalty import kl_in_reward
from jppo.rewards.placement import last_token_scores, token_credit_rewards
from jppo.run.collect import decode_responses

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def qwen_like_tokenizer(directory):
    """A word-level tokenizer with Qwen's two EOS tokens: ``<|im_end|>`` (the tokenizer's eos_token) and
    ``<|endoftext|>`` (added by generation_config.json)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + ["<unk>", "hi", "there"])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": None}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return load_tokenizer(str(directory))


def test_every_eos_id_stops_sampling_and_marks_the_response_finished(tmp_path):
    tok = qwen_like_tokenizer(tmp_path)
    im_end, endoftext, hi = tok.encode("<|im_end|> <|endoftext|> hi")
    assert tok.eos_ids == (im_end, endoftext)
    cfg = load_config(QUICKSTART, [])
    for kind in ({}, {"evaluation": True}, {"greedy_baseline": True}):
        assert set(sampling_params(cfg, tok, **kind).eos_token_ids) == {im_end, endoftext}
    ids = np.array([[hi, im_end, 0], [hi, endoftext, 0], [hi, hi, hi]], np.int32)
    mask = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 1]], bool)
    batch = Experience(np.full((3, 1), hi, np.int32), np.ones((3, 1), bool), ids, mask)
    texts, finished = decode_responses(batch, tok)
    assert finished == [True, True, False]
    assert texts == ["hi", "hi", "hi hi hi"]


def test_scores_go_on_the_last_valid_token_and_nowhere_for_empty_responses():
    mask = np.array([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]], bool)  # a hole, an empty row
    out = last_token_scores(np.array([0.5, -1.0, 7.0], np.float32), mask)
    expected = np.zeros((3, 4), np.float32)
    expected[0, 2], expected[1, 2] = 0.5, -1.0
    np.testing.assert_array_equal(out, expected)


def test_token_credit_sums_to_the_score_and_follows_characters():
    task = get_task("reverse_digits")
    tokenizer = CharTokenizer(task.alphabet)
    example = Example(prompt="123=", answer="321")
    texts = ["329", "32", "3219", ""]
    ids = np.zeros((4, 6), np.int32)
    mask = np.zeros((4, 6), bool)
    for row, text in enumerate(texts):
        tokens = tokenizer.encode(text) + [tokenizer.eos_id]
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = True
    finished = [True] * 4
    scores = np.array([task.score(t, example) for t in texts], np.float32) + 0.125  # + a format bonus
    credits = [task.credit(t, example, True) for t in texts]
    out = token_credit_rewards(ids, mask, credits, finished, scores, tokenizer.decode)
    np.testing.assert_allclose(out.sum(axis=1), scores, rtol=1e-6)
    # "329" vs "321": the first two characters earn 1/3 each; the EOS earns only the format bonus
    np.testing.assert_allclose(out[0, :4], [1 / 3, 1 / 3, 0, 0.125], rtol=1e-6)
    # "3219": the answer, then an ignored "9"
    np.testing.assert_allclose(out[2, :5], [1 / 3, 1 / 3, 1 / 3, 0, 0.125], rtol=1e-6)
    assert not out[~mask].any()


def test_token_credit_of_a_truncated_response_has_no_eos_entry():
    task = get_task("reverse_digits")
    tokenizer = CharTokenizer(task.alphabet)
    example = Example(prompt="12=", answer="21")
    ids = np.array([tokenizer.encode("211")], np.int32)
    mask = np.ones((1, 3), bool)
    credits = [task.credit("211", example, False)]
    out = token_credit_rewards(ids, mask, credits, [False], np.array([task.score("211", example, False)]),
                               tokenizer.decode)
    # float32: the (zero) remainder score - sum(credits) on the last token is a rounding error of ~1e-8
    np.testing.assert_allclose(out[0], [0.5, 0.5, 0], rtol=1e-6, atol=1e-7)


def test_kl_in_reward_subtracts_the_penalty_per_token_and_reports_mean_sequence_kl():
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    old = np.array([[-1.0, -2.0, np.nan], [-0.5, np.inf, 0.0]], np.float32)
    ref = np.array([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]], np.float32)
    scores = np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]], np.float32)
    rewards, current_kl = kl_in_reward(scores, old, ref, mask, kl_coef=0.1, kind="kl")
    np.testing.assert_allclose(rewards[mask], [0.0 - 0.1 * 0.5, 1.0 - 0.1 * -1.0, 2.0], rtol=1e-6)
    # per-sequence token means: (0.5 - 1.0) / 2 and 0.0, averaged over the two sequences
    assert current_kl == pytest.approx(-0.125)


def test_compute_advantages_passes_only_what_the_estimator_takes():
    rng = np.random.default_rng(0)
    mask = np.ones((4, 3), bool)
    rewards = last_token_scores(np.array([1.0, 0.0, 0.5, 0.5], np.float32), mask)
    values = rng.normal(size=(4, 3)).astype(np.float32)
    grpo, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, values=values,
                                 group_ids=np.array([0, 0, 1, 1]))
    # group {1, 0}: mean 0.5, unbiased std sqrt(0.5); the tied group {0.5, 0.5} gets 0
    np.testing.assert_allclose(grpo[:, 0], [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5), 0, 0], rtol=1e-4)
    gae, returns = compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=values,
                                      group_ids=np.array([0, 0, 1, 1]), gamma=1.0, lam=1.0)
    # lam = gamma = 1: returns are the rewards-to-go
    # (float32: returns = advantages + values, so ~1e-7 absolute rounding where the reward-to-go is 0)
    np.testing.assert_allclose(returns, np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1], rtol=1e-6, atol=1e-6)
    assert gae.shape == (4, 3)


def test_compute_advantages_checks_its_inputs_as_the_one_dispatcher_does():
    """Collection runs estimators through :func:`run_estimator`, so a missing input is the same one-line error
    naming the estimator and what it takes, not a Python argument error from inside a trace."""
    mask = np.ones((2, 3), bool)
    rewards = last_token_scores(np.array([1.0, 0.0], np.float32), mask)
    with pytest.raises(ValueError, match="advantage estimator 'gae' is missing input\\(s\\) values; it takes"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask)


def test_compute_advantages_on_a_mesh_equals_the_arrays_as_given():
    """``place=on_mesh`` (the run's path): the estimator runs on the global row-sharded batch over 8 devices and
    each row comes back where it was, with the whole batch's statistics (RLOO's leave-one-out baselines)."""
    rng = np.random.default_rng(3)
    mask = rng.random((16, 5)) < 0.8
    rewards = last_token_scores(rng.normal(size=16).astype(np.float32), mask)
    inputs = dict(token_level_rewards=rewards, response_mask=mask, group_ids=np.repeat(np.arange(4), 4))
    mesh = make_mesh(data=8)
    sharded, _ = compute_advantages("rloo", **inputs, place=functools.partial(on_mesh, mesh=mesh))
    alone, _ = compute_advantages("rloo", **inputs)
    assert isinstance(sharded, np.ndarray) and np.abs(alone).sum() > 0
    np.testing.assert_allclose(sharded, alone, rtol=1e-6, atol=1e-7)
