"""``python -m jppo.train --config configs/quickstart.yaml [key.sub=value ...]``: the PPO / GRPO training loop.

One training step, top to bottom (:meth:`Trainer.step`):

1. take ``data.train_batch_size`` prompts at the saved data position;
2. sample ``rollout.n`` responses per prompt with the KV-cache sampler;
3. score them (task scorer, rule or plug-in) and put each score on the response's last token (or, with
   ``reward.token_level``, spread a built-in task's per-position credit over the tokens); for ReMax, also decode
   one greedy response per prompt, whose reward is the prompt's baseline;
4. recompute old log-probs (and reference log-probs, values) over the whole batch in micro-batches;
5. optionally subtract ``kl_coef * KL(old || ref)`` from the rewards (fixed or adaptive controller);
6. compute advantages over the whole batch (``algorithm.adv_estimator``);
7. ``ppo_epochs`` x mini-batches of critic, then actor, updates through the engine;
8. log metrics; validate every ``trainer.val_every`` steps; checkpoint every ``trainer.save_every`` steps.

Restarting the same command resumes from the newest complete checkpoint (``trainer.resume: auto``): parameters,
optimizer states, data position, KL controller and step are restored, and every random draw is a function of
(seed, step), so the resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import pathlib
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jppo import components, distributed
from jppo.advantages import get_estimator
from jppo.checkpoint import CheckpointManager, resolve_resume
from jppo.distributed import DistributedError
from jppo.config import ConfigError, TrainConfig, check_mesh, engine_update_config, load_config, save_config, to_dict
from jppo.engine import (
    TrainState,
    UpdateStep,
    actor_loss_fn,
    critic_loss_fn,
    forward_batch,
    init_train_state,
    log_prob_fn,
    run_updates,
    value_fn,
)
from jppo.experience import compute_advantages, kl_in_reward, last_token_scores, token_credit_rewards, with_per_token
from jppo.losses import AdaptiveKLController, FixedKLController, KLControlState
from jppo.mesh import make_mesh
from jppo.microbatch import SequenceBatch
from jppo.models import CheckpointError, save_pretrained
from jppo.hostlocal import max_over_processes, sum_over_processes
from jppo.runlog import RunLogger

log = logging.getLogger("jppo.train")


class PhaseTimer:
    """Wall time per phase of a step (``timing/<phase>`` metrics). Every phase ends with its results on the host,
    so asynchronous dispatch does not move time from one phase into the next."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def kl_controller(cfg: TrainConfig):
    ctrl = cfg.algorithm.kl_ctrl
    if ctrl.type == "adaptive":
        return AdaptiveKLController(init_kl_coef=ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)
    return FixedKLController(kl_coef=ctrl.kl_coef)


class Trainer:
    """Holds the run's models and states; :meth:`step` is one training step (see the module docstring)."""

    def __init__(
        self, cfg: TrainConfig, mesh_shape: tuple[int, int, int], inputs: components.RunInputs,
        devices: Optional[Sequence[jax.Device]] = None,
    ):
        self.cfg = cfg
        self.inputs = inputs
        self.mesh = make_mesh(*mesh_shape, devices=devices)
        self.actor_cfg = engine_update_config(cfg, "actor")
        self.critic_cfg = engine_update_config(cfg, "critic")
        tokenizer = inputs.tokenizer

        policy = components.build_policy(cfg, tokenizer, self.mesh)
        self.graphdef, params = nnx.split(policy, nnx.Param)
        self.ref_params = components.build_reference(cfg, policy, self.mesh) if cfg.use_reference else None
        self.critic: Optional[TrainState] = None
        if cfg.use_critic:
            critic_graphdef, critic_params = nnx.split(components.build_critic(cfg, policy, self.mesh), nnx.Param)
            self.critic = init_train_state(critic_params, self.critic_cfg, self.mesh)
            self.critic_step = UpdateStep(critic_graphdef, critic_loss_fn(self.critic_cfg), self.critic_cfg, self.mesh, "critic")
            self.values_of = value_fn(critic_graphdef)
        self.actor = init_train_state(params, self.actor_cfg, self.mesh)
        self.actor_step = UpdateStep(
            self.graphdef, actor_loss_fn(self.actor_cfg, cfg.rollout.temperature), self.actor_cfg, self.mesh, "actor"
        )
        self.log_probs_of = log_prob_fn(
            self.graphdef, temperature=cfg.rollout.temperature, chunk_size=self.actor_cfg.logprob_chunk_size
        )
        self.sampler = components.Sampler(
            self.graphdef, tokenizer, self.mesh, components.sampling_params(cfg, tokenizer), cfg.rollout.prompt_bucket
        )
        self.val_sampler = components.Sampler(
            self.graphdef, tokenizer, self.mesh, components.sampling_params(cfg, tokenizer, validation=True),
            cfg.rollout.prompt_bucket,
        )
        self.baseline_sampler = None
        if get_estimator(cfg.algorithm.adv_estimator).needs_reward_baselines:
            # ReMax: the baseline of a prompt is the reward of the policy's greedy response to it
            self.baseline_sampler = components.Sampler(
                self.graphdef, tokenizer, self.mesh, components.sampling_params(cfg, tokenizer, greedy_baseline=True),
                cfg.rollout.prompt_bucket,
            )
        self.reward_model = components.RewardModel(cfg, self.mesh) if cfg.reward.model_path else None
        self.kl_ctrl = kl_controller(cfg)
        self.kl_state: KLControlState = self.kl_ctrl.init()
        self.data_position = 0
        self.step_done = 0
        self.key = jax.random.key(cfg.trainer.seed)

    # ----------------------------------------------------------------- checkpoints
    def _checkpointed(self) -> dict:
        state = {"actor": self.actor}
        if self.critic is not None:
            state["critic"] = self.critic
        return state

    def save(self, manager: CheckpointManager) -> None:
        meta = {
            "step": self.step_done,
            "data_position": self.data_position,
            "kl_coef": float(self.kl_state.coef),
            "config": to_dict(self.cfg),
        }
        manager.save(self.step_done, self._checkpointed(), meta)

    def restore(self, manager: CheckpointManager, which) -> None:
        """Restores into the current states' shapes and shardings (so a checkpoint from another mesh fits)."""
        state, meta = manager.restore(which, self._checkpointed())
        self.actor = state["actor"]
        if self.critic is not None:
            self.critic = state["critic"]
        self.step_done = int(meta["step"])
        self.data_position = int(meta["data_position"])
        self.kl_state = KLControlState(coef=jnp.asarray(meta["kl_coef"], jnp.float32))

    # ----------------------------------------------------------------- one step
    def step(self) -> dict[str, float]:
        cfg, tokenizer = self.cfg, self.inputs.tokenizer
        step = self.step_done + 1
        timer = PhaseTimer()
        started = time.perf_counter()

        examples, prompts, self.data_position = self.inputs.train_data.batch_at(
            self.data_position, cfg.data.train_batch_size, cfg.trainer.seed
        )
        with timer("rollout"):
            # this process's rows; prompt_index says which prompt each row answers
            batch, prompt_index = self.sampler(self.actor.params, prompts, jax.random.fold_in(self.key, step))
        with timer("reward"):
            row_examples = [examples[i] for i in prompt_index]
            texts, finished, scores = self.score(batch, row_examples)
        reward_baselines = None
        if self.baseline_sampler is not None:
            with timer("reward_baseline"):
                reward_baselines = self.greedy_baselines(examples, prompts, prompt_index, step)
        mask = batch.response_mask
        actor_cut = components.forward_micro_batching(cfg, "actor")
        with timer("old_log_prob"):
            old_log_prob = forward_batch(self.log_probs_of, self.actor.params, batch, self.mesh, **actor_cut)
        extra = {}
        if self.ref_params is not None:
            with timer("ref_log_prob"):
                extra["ref_log_prob"] = forward_batch(self.log_probs_of, self.ref_params, batch, self.mesh, **actor_cut)
        values = None
        if self.critic is not None:
            with timer("values"):
                critic_cut = components.forward_micro_batching(cfg, "critic")
                values = forward_batch(self.values_of, self.critic.params, batch, self.mesh, **critic_cut)
        metrics: dict[str, float] = {}
        with timer("advantages"):
            if self.inputs.credit_fn is not None:
                rewards = token_credit_rewards(
                    batch.response_ids, mask, self.inputs.credit_fn(texts, row_examples, finished), finished, scores,
                    tokenizer.decode,
                )
            else:
                rewards = last_token_scores(scores, mask)
            if cfg.algorithm.use_kl_in_reward:
                rewards, current_kl = kl_in_reward(
                    rewards, old_log_prob, extra["ref_log_prob"], mask, kl_coef=float(self.kl_state.coef),
                    kind=cfg.algorithm.kl_penalty, mesh=self.mesh,
                )
                metrics["algorithm/kl_in_reward"] = current_kl
                metrics["algorithm/kl_coef"] = float(self.kl_state.coef)
                self.kl_state = self.kl_ctrl.update(self.kl_state, current_kl, len(prompts) * cfg.rollout.n)
            advantages, returns = compute_advantages(
                cfg.algorithm.adv_estimator, token_level_rewards=rewards, response_mask=mask, values=values,
                group_ids=prompt_index, reward_baselines=reward_baselines, gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam, norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, mesh=self.mesh,
            )
        per_token = dict(old_log_prob=old_log_prob, advantages=advantages, returns=returns, **extra)
        if values is not None:
            per_token["values"] = values
        batch = with_per_token(batch, **per_token)

        update_rng = np.random.default_rng([cfg.trainer.seed, step])
        if self.critic is not None:
            with timer("update_critic"):
                self.critic, critic_metrics, _ = run_updates(
                    self.critic_step, self.critic, batch, self.critic_cfg, self.mesh, update_rng,
                    self.critic_cfg.loss_scale_factor,
                )
            metrics.update(critic_metrics)
        if step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                self.actor, actor_metrics, _ = run_updates(
                    self.actor_step, self.actor, batch, self.actor_cfg, self.mesh, update_rng,
                    self.actor_cfg.loss_scale_factor,
                )
            metrics.update(actor_metrics)

        metrics.update(batch_metrics(batch, scores, advantages, returns, values, cfg.rollout.max_response_length))
        total = time.perf_counter() - started
        metrics.update({f"timing/{phase}": seconds for phase, seconds in timer.seconds.items()})
        metrics["timing/step"] = total
        metrics["perf/tokens_per_s"] = metrics.pop("_tokens") / total
        self.step_done = step
        return metrics

    def score(self, batch: SequenceBatch, row_examples: list) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Decoded responses, whether each ended, and each row's reward (rule/plug-in reward plus the reward
        model's score when there is one)."""
        texts, finished = components.decode_responses(batch, self.inputs.tokenizer)
        scores = np.asarray(self.inputs.reward_fn(texts, row_examples, finished), np.float32)
        if self.reward_model is not None:
            scores = scores + self.reward_model(batch)
        return texts, finished, scores

    def greedy_baselines(self, examples: list, prompts: list, prompt_index: np.ndarray, step: int) -> np.ndarray:
        """ReMax baselines: for every row, the reward of the current policy's greedy response to its prompt."""
        greedy, greedy_index = self.baseline_sampler(
            self.actor.params, prompts, jax.random.fold_in(self.key, step)  # greedy: the key is unused
        )
        _, _, greedy_scores = self.score(greedy, [examples[i] for i in greedy_index])
        by_prompt = dict(zip(greedy_index.tolist(), greedy_scores.tolist()))
        return np.asarray([by_prompt[i] for i in prompt_index.tolist()], np.float32)

    def validate(self) -> dict[str, float]:
        """Rewards of ``rollout.val_n`` samples per held-out prompt (greedy when ``rollout.val_temperature`` is 0).
        Each process scores its rows; the sums are combined over processes."""
        cfg, data, n = self.cfg, self.inputs.val_data, self.cfg.rollout.val_n
        totals = np.zeros(3)  # reward sum, solved samples, prompts solved by at least one sample
        for index, (examples, prompts) in enumerate(data.batches(cfg.data.val_batch_size)):
            key = jax.random.fold_in(jax.random.key(cfg.trainer.seed + 7), index)
            batch, prompt_index = self.val_sampler(self.actor.params, prompts, key)
            _, _, scores = self.score(batch, [examples[i] for i in prompt_index])
            solved = (scores >= 1.0 - 1e-6).reshape(-1, n)  # rows of one prompt are adjacent and on one process
            totals += [scores.sum(), solved.sum(), solved.any(axis=1).sum()]
        reward_sum, solved_samples, solved_prompts = sum_over_processes(totals)
        prompts = len(data)
        out = {"val/reward/mean": reward_sum / (prompts * n), "val/accuracy": solved_samples / (prompts * n)}
        if n > 1:
            out[f"val/pass@{n}"] = solved_prompts / prompts
        return {k: float(v) for k, v in out.items()}

    def export(self, path: pathlib.Path) -> None:
        """The policy as a Hugging Face directory (parameters gathered tensor by tensor; the main process writes)."""
        params = jax.tree.map(gather_to_host, self.actor.params)
        if jax.process_index() == 0:
            save_pretrained(nnx.merge(self.graphdef, params), path)


def gather_to_host(array: jax.Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def batch_metrics(batch: SequenceBatch, scores, advantages, returns, values, max_length: int) -> dict[str, float]:
    """Whole-batch statistics of the rollout (token means over the response mask), combined over processes."""
    mask = batch.response_mask.astype(bool)
    lengths = batch.response_attention.sum(axis=1)
    token_sum = lambda x: np.where(mask, x, 0).sum()  # noqa: E731
    logprob_gap = np.abs(batch.per_token["rollout_log_prob"] - batch.per_token["old_log_prob"])
    sums = sum_over_processes(np.array([
        len(scores), mask.sum(), scores.sum(), lengths.sum(), (lengths >= max_length).sum(), token_sum(advantages),
        token_sum(returns), token_sum(logprob_gap), 0.0 if values is None else token_sum(values),
        batch.prompt_mask.sum() + batch.response_attention.sum(),
    ], np.float64))
    rows, tokens = sums[0], max(sums[1], 1)
    reward_max, reward_min_negated, length_max = max_over_processes([scores.max(), -scores.min(), lengths.max()])
    out = {
        "reward/mean": sums[2] / rows,
        "reward/max": reward_max,
        "reward/min": -reward_min_negated,
        "response_length/mean": sums[3] / rows,
        "response_length/max": length_max,
        "response_length/clip_ratio": sums[4] / rows,
        "advantages/mean": sums[5] / tokens,
        "returns/mean": sums[6] / tokens,
        # agreement of the sampler's and the trainer's log-probs of the same tokens (should be ~0)
        "rollout/logprob_abs_diff": sums[7] / tokens,
        "_tokens": sums[9],
    }
    if values is not None:
        out["values/mean"] = sums[8] / tokens
    return {k: float(v) for k, v in out.items()}


def run(
    cfg: TrainConfig, mesh_shape: tuple[int, int, int], inputs: components.RunInputs,
    devices: Optional[Sequence[jax.Device]] = None,
) -> dict[str, float]:
    """Trains to ``trainer.total_steps`` on ``devices`` (default: all), resuming when a checkpoint exists; returns
    the last step's metrics."""
    out = pathlib.Path(cfg.trainer.output_dir)
    main = distributed.is_main_process()
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    trainer = Trainer(cfg, mesh_shape, inputs, devices)
    manager = CheckpointManager(out / "checkpoints", max_to_keep=cfg.trainer.max_checkpoints_to_keep)
    resume = resolve_resume(cfg.trainer.resume, manager.directory)
    if resume is not None:
        trainer.restore(manager, resume)
        log.info("resumed from %s at step %d", resume, trainer.step_done)
    last: dict[str, float] = {}
    fresh = trainer.step_done == 0
    with RunLogger(
        out, total_steps=cfg.trainer.total_steps, tensorboard=cfg.trainer.tensorboard,
        progress_bar=cfg.trainer.progress_bar, start_step=0 if fresh else trainer.step_done + 1, is_main_process=main,
    ) as logger:
        if cfg.trainer.val_before_train and inputs.val_data is not None and fresh:
            # the initial policy's validation, at step 0 (verl's global step 0); a resumed run does not repeat it
            logger.log(0, trainer.validate())
        while trainer.step_done < cfg.trainer.total_steps:
            last = trainer.step()
            step = trainer.step_done
            if inputs.val_data is not None and cfg.trainer.val_every and step % cfg.trainer.val_every == 0:
                last.update(trainer.validate())
            logger.log(step, last)
            if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or step == cfg.trainer.total_steps:
                if manager.latest_step() != step:
                    trainer.save(manager)
    manager.close()
    if cfg.trainer.export_hf:
        trainer.export(out / "hf")
    if cfg.trainer.plots and main:
        from jppo.plot import plot_run

        plot_run(out)
    return last


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jppo.train", description="Train a language model with PPO / GRPO / RLOO / REINFORCE++."
    )
    parser.add_argument("--config", help="YAML config (default: the embedded quickstart defaults)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. trainer.total_steps=10")
    distributed.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        distributed.initialize(args)
        mesh_shape = check_mesh(cfg, jax.device_count(), jax.process_count())
        inputs = components.load_inputs(cfg)
    except (ConfigError, CheckpointError, DistributedError, ValueError, KeyError, FileNotFoundError) as error:
        print(f"jppo.train: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    final = run(cfg, mesh_shape, inputs)
    if not distributed.is_main_process():
        return 0
    summary = ", ".join(f"{k}={final[k]:.4g}" for k in ("reward/mean", "actor/pg_loss", "critic/vf_loss") if k in final)
    print(f"jppo.train: done: step {cfg.trainer.total_steps}, {summary}, output in {cfg.trainer.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
