"""The reward model: a value-head checkpoint scoring each sequence at its last response token."""

import jax.numpy as jnp
import numpy as np

from jppo.config import load_config, views
from jppo.core.experience import Experience
from jppo.models import ValueModel, create_model, save_pretrained
from jppo.parallel.mesh import make_mesh
from jppo.rewards.model import RewardModel
from jppo.run import build


def test_reward_model_scores_the_last_response_token(tmp_path):
    cfg = load_config(None, ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                             "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1"])
    tokenizer = build.load_inputs(cfg).tokenizer
    scorer = create_model(ValueModel, views.random_model_config(cfg, tokenizer), None, seed=3)
    save_pretrained(scorer, tmp_path / "rm")
    cfg = load_config(None, [f"reward.model_path={tmp_path / 'rm'}", "data.train_batch_size=8",
                             "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                             "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1"])
    mesh = make_mesh(-1, 1, 1)
    reward_model = RewardModel(cfg.reward.model_path, cfg.model.dtype, mesh,
                               views.forward_micro_batching(cfg, "critic"))
    rng = np.random.default_rng(0)
    prompt_mask = np.arange(4)[None, :] >= rng.integers(0, 3, (8, 1))  # left padding, at least one real token
    lengths = np.array([3, 1, 0, 5, 2, 4, 5, 1])
    attention = np.arange(5)[None, :] < lengths[:, None]
    batch = Experience(
        np.where(prompt_mask, rng.integers(3, tokenizer.vocab_size, (8, 4)), 0), prompt_mask,
        np.where(attention, rng.integers(3, tokenizer.vocab_size, (8, 5)), 0), attention,
    )
    scores = reward_model(batch)
    # direct: the model over each sequence's real tokens alone, its output at the last one
    for row in range(8):
        tokens = np.concatenate([batch.prompt_ids[row][prompt_mask[row]], batch.response_ids[row][attention[row]]])
        values = scorer(jnp.asarray(tokens[None]))
        expected = float(values[0, -1]) if lengths[row] else 0.0
        np.testing.assert_allclose(scores[row], expected, rtol=1e-5, atol=1e-6)
