"""Collecting experience: one training step's rollout, scored, with everything the losses need.

:func:`collect` runs, over the WHOLE rollout batch (``B * n`` sequences, rows prompt-major), before the engine
cuts it into mini- and micro-batches, so batch-wide statistics (advantage whitening, group baselines, the KL
controller's measurement) are global by construction:

1. take ``data.train_batch_size`` prompts at the saved data position;
2. sample ``rollout.n`` responses per prompt with the KV-cache sampler (with ``rollout.env``, turn by turn with the
   environment, :mod:`jppo.rollout.multiturn`);
3. score them (task scorer, rule or plug-in, plus a reward model) and put each score on the response's last token
   (or, with ``reward.token_level``, spread a built-in task's per-position credit over the tokens), and an
   environment's per-turn rewards on their turns' last tokens (:mod:`jppo.rewards.placement`); for ReMax,
   also decode one greedy response per prompt, whose reward is the prompt's baseline;
4. recompute old log-probs (and reference log-probs, values) over the whole batch in micro-batches (its tokens
   cross to the devices once for all these passes); no old-log-prob pass when the update takes its own or the
   sampler's (``actor.old_log_prob``, :func:`jppo.config.views.old_log_prob_source`);
5. optionally subtract ``kl_coef * KL(old || ref)`` from the rewards (fixed or adaptive controller,
   :mod:`jppo.rewards.kl_penalty`);
6. compute advantages and returns (``algorithm.adv_estimator``, :mod:`jppo.advantages.estimate`).

Collecting consumes prompts and measures the KL, so it advances the run state's data position and KL controller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jppo.advantages import get_estimator
from jppo.advantages.estimate import compute_advantages
from jppo.config import TrainConfig, views
from jppo.core.experience import Experience
from jppo.data import Tokenizer
from jppo.engine import forward_batch, log_prob_fn, value_fn
from jppo.engine.assemble import device_rows
from jppo.parallel.hostlocal import max_over_processes, on_mesh, on_one_device, sum_over_processes, sum_over_rows
from jppo.rewards.kl_penalty import kl_in_reward
from jppo.rewards.model import RewardModel
from jppo.rewards.overlong import overlong_penalty
from jppo.rewards.placement import env_rewards, place_rewards
from jppo.rollout import JppoEngine, Sampler
from jppo.rollout.multiturn import MultiTurnSampler
from jppo.run import build
from jppo.run.filters import (
    DynamicSamplingError,
    Scored,
    concat,
    overlong_filtered,
    rejected_rows_cleared,
    sampling_metrics,
    varied_groups,
)
from jppo.run.rollout_mesh import WeightMove, batch_bytes
from jppo.run.state import RunState, advance
from jppo.runlog.timing import PhaseTimer


@dataclasses.dataclass(frozen=True)
class Collector:
    """The programs and inputs of the collection stage (built once; the run's state is passed to each call)."""

    cfg: TrainConfig
    mesh: Mesh
    inputs: build.RunInputs
    sampler: Sampler | MultiTurnSampler  # multi-turn with rollout.env
    val_sampler: Sampler | MultiTurnSampler
    baseline_sampler: Optional[Sampler | MultiTurnSampler]  # ReMax: greedy responses, whose rewards are the baselines
    log_probs_of: object
    values_of: Optional[object]
    ref_params: Optional[nnx.State]
    reward_model: Optional[RewardModel]
    # LoRA: the reference is the actor's frozen base weights, read through the structure without adapters
    ref_log_probs_of: Optional[object] = None
    engine: object = None  # rollout.engine's (jppo.rollout.ROLLOUT_ENGINES): the samplers' engine
    weight_move: Optional[WeightMove] = None  # rollout.devices: the samplers' own mesh, the weights moved to it
    # the config in the units collection works in, derived once (views): how the actor's and the critic's forward
    # passes cut the batch, where the old log-probs come from, and the KL-in-reward coefficient's controller
    actor_cut: dict = dataclasses.field(default_factory=dict)
    critic_cut: dict = dataclasses.field(default_factory=dict)
    old_log_prob_source: str = "recompute"
    kl_controller: object = None

    @classmethod
    def create(
        cls, cfg: TrainConfig, mesh: Mesh, inputs: build.RunInputs, policy: nnx.GraphDef,
        critic: Optional[nnx.GraphDef], ref_params: Optional[nnx.State], sampling: Optional[nnx.GraphDef] = None,
        base: Optional[nnx.GraphDef] = None, engine: object = None, weight_move: Optional[WeightMove] = None,
    ) -> "Collector":
        """``sampling``: the policy's structure as the sampler runs it (``rollout.dtype``; default ``policy``).
        ``base``: the policy's structure without its LoRA adapters (None without LoRA); the reference log-probs
        then run it on ``ref_params``, or on the actor's frozen base weights when there is no ``ref.model_path``.
        ``engine``: the started ``rollout.engine`` every sampler samples with (default: jppo's own sampler).
        ``weight_move``: the rollout's own mesh (``rollout.devices``, :mod:`jppo.run.rollout_mesh`), where the
        samplers then run; default: ``mesh``."""
        tokenizer, on = inputs.tokenizer, mesh if weight_move is None else weight_move.mesh
        engine = JppoEngine(None) if engine is None else engine

        def sampler(**kind) -> Sampler | MultiTurnSampler:
            params = views.sampling_params(cfg, tokenizer, **kind)
            if inputs.env_factory is None:
                return engine.sampler(sampling or policy, tokenizer.pad_id, on, params, cfg.rollout.prompt_bucket)
            turn = dataclasses.replace(params, n=1, eos_token_ids=params.eos_token_ids + inputs.stop_ids)
            return MultiTurnSampler(
                engine.sampler(sampling or policy, tokenizer.pad_id, on, turn, cfg.rollout.prompt_bucket),
                inputs.env_factory, tokenizer, n=params.n, stop_ids=inputs.stop_ids, max_turns=cfg.rollout.max_turns,
                max_length=cfg.rollout.max_response_length, bucket=cfg.rollout.prompt_bucket,
                max_prompt_length=cfg.data.max_prompt_length, env=cfg.rollout.env,
            )

        needs_baselines = get_estimator(cfg.algorithm.adv_estimator).needs_reward_baselines
        reward_model = None
        if cfg.reward.model_path:
            cut = views.forward_micro_batching(cfg, "critic" if cfg.use_critic else "actor")
            reward_model = RewardModel(cfg.reward.model_path, cfg.model.dtype, mesh, cut)
        return cls(
            cfg=cfg, mesh=mesh, inputs=inputs, sampler=sampler(), val_sampler=sampler(evaluation=True),
            baseline_sampler=sampler(greedy_baseline=True) if needs_baselines else None,
            log_probs_of=log_prob_fn(
                policy, temperature=cfg.rollout.temperature, chunk_size=cfg.actor.log_prob_chunk_size
            ),
            values_of=None if critic is None else value_fn(critic),
            ref_params=ref_params, reward_model=reward_model, engine=engine, weight_move=weight_move,
            ref_log_probs_of=None if base is None or not cfg.use_reference else log_prob_fn(
                base, temperature=cfg.rollout.temperature, chunk_size=cfg.actor.log_prob_chunk_size
            ),
            actor_cut=views.forward_micro_batching(cfg, "actor"),
            critic_cut=views.forward_micro_batching(cfg, "critic"),
            old_log_prob_source=views.old_log_prob_source(cfg), kl_controller=views.kl_controller(cfg),
        )

    def sampling_weights(self, weights: nnx.State, timer: Optional[PhaseTimer] = None) -> tuple[nnx.State, dict]:
        """``weights`` where the samplers run, and the move's metrics: as they are on a shared mesh (no metric);
        moved to the rollout mesh (``timing/weight_move`` on ``timer``, ``perf/weight_move_bytes``) otherwise."""
        if self.weight_move is None:
            return weights, {}
        with timer("weight_move") if timer is not None else contextlib.nullcontext():
            moved, size = self.weight_move(weights)
        return moved, {"perf/weight_move_bytes": float(size)}

    def score(self, batch: Experience, row_examples: list) -> tuple[list[str], list[bool], np.ndarray]:
        """Decoded responses, whether each ended, and each row's reward (rule/plug-in reward, plus the reward
        model's score when there is one, plus the environment's rewards of a multi-turn rollout)."""
        texts, finished = decode_responses(batch, self.inputs.tokenizer)
        scores = np.asarray(self.inputs.reward_fn(texts, row_examples, finished), np.float32)
        scores = scores + env_rewards(batch).sum(axis=1)
        if self.reward_model is not None:
            scores = scores + self.reward_model(batch)
        return texts, finished, scores

    def reward_failures(self, prefix: str = "") -> dict[str, float]:
        """``{prefix}reward/errors`` and ``{prefix}reward/timeouts``: the reward calls scored 0 under
        ``reward.on_error: zero`` since the last call, summed over processes; nothing under ``raise`` (a failure
        stops the run there)."""
        drain = getattr(self.inputs.reward_fn, "drain", None)  # a bare function (tests): nothing is counted
        if self.cfg.reward.on_error != "zero" or drain is None:
            return {}
        tally = drain()
        errors, timeouts = sum_over_processes(np.array([tally.errors, tally.timeouts], np.float64))
        return {f"{prefix}reward/errors": float(errors), f"{prefix}reward/timeouts": float(timeouts)}

    def score_for_training(self, batch: Experience, examples: list, prompts: list) -> Scored:
        """:meth:`score` of a training batch (``group_ids`` index ``examples``), and the training reward: the
        score plus the overlong penalty when ``reward.overlong_buffer`` is on."""
        texts, finished, scores = self.score(batch, [examples[i] for i in batch.group_ids])
        rewards = scores
        buffer = self.cfg.reward.overlong_buffer
        if buffer.enable:
            lengths = batch.response_attention.sum(axis=1)
            penalty = overlong_penalty(lengths, self.cfg.rollout.max_response_length, buffer.len, buffer.penalty_factor)
            rewards = (scores + penalty).astype(np.float32)
        return Scored(batch, examples, prompts, texts, finished, scores, rewards)


def sample(sampler, params, prompts: list, key: jax.Array, examples: list) -> Experience:
    """One sampler's rows for ``prompts``; a multi-turn sampler also gets the prompts' ``examples`` (env.reset)."""
    if isinstance(sampler, MultiTurnSampler):
        return sampler(params, prompts, key, examples)
    return sampler(params, prompts, key)


def sample_and_score(c: Collector, state: RunState, step: int, timer: PhaseTimer,
                     moved: Optional[tuple[nnx.State, dict]] = None) -> tuple[Scored, int, dict[str, float]]:
    """The step's sampled and scored batch (:func:`sampled_and_scored`, with ``state``'s weights where the samplers
    run: ``moved``, what :meth:`Collector.sampling_weights` gave for them, when already there), the data position
    after the prompts it consumed, and the dynamic sampling and move metrics."""
    weights, moves = c.sampling_weights(state.actor.weights, timer) if moved is None else moved
    scored, position, metrics = sampled_and_scored(c, state, step, timer, weights)
    if c.weight_move is not None:
        moves["perf/batch_move_bytes"] = float(batch_bytes(scored.exp))
    return scored, position, metrics | moves


def sampled_and_scored(
    c: Collector, state: RunState, step: int, timer: PhaseTimer, weights: nnx.State
) -> tuple[Scored, int, dict[str, float]]:
    """The step's sampled and scored batch, the data position after the prompts it consumed, and the dynamic
    sampling metrics. Without ``algorithm.filter_groups`` that is one batch of ``data.train_batch_size`` prompts;
    with it, batches are drawn (batch ``g`` > 0 with the key ``fold_in(step key, g)``) until that many varied groups
    are kept (:mod:`jppo.run.filters`). Every draw is a function of the seed, the step and the data position,
    so a resumed run samples the same batches."""
    cfg = c.cfg
    groups, size = cfg.algorithm.filter_groups, cfg.data.train_batch_size
    position, kept, num_varied, num_kept, gen = int(np.asarray(state.data_position)), [], [], 0, 0
    while True:
        examples, prompts, position = c.inputs.train_data.batch_at(position, size, cfg.trainer.seed)
        key = state.key(step) if gen == 0 else jax.random.fold_in(state.key(step), gen)
        if c.engine.pushes_weights and gen == 0:  # an external engine gets the updated policy (the sampler would too)
            with timer("weight_push"):
                c.engine.push(state.actor.weights)
        with timer("rollout"):
            exp = sample(c.sampler, weights, prompts, key, examples)  # group_ids: each row's prompt
        with timer("reward"):
            scored = c.score_for_training(exp, examples, prompts)
        gen += 1
        if not groups.enable:
            return scored, position, engine_metrics(c.engine)
        varied = varied_groups(scored.rewards if groups.metric == "reward" else scored.scores, exp.group_ids)
        num_varied.append(len(varied))
        take = varied[: size - num_kept]
        kept.append(scored.groups(take))
        num_kept += len(take)
        if num_kept == size:
            break
        if groups.max_num_gen_batches and gen >= groups.max_num_gen_batches:
            raise DynamicSamplingError(
                f"step {step}: {gen} prompt batches gave {num_kept} of data.train_batch_size={size} prompts with "
                f"varied {groups.metric}s (algorithm.filter_groups.max_num_gen_batches={groups.max_num_gen_batches}); "
                "the data may be too hard or too easy for the policy (0 samples without limit)"
            )
    return concat(kept, c.inputs.tokenizer.pad_id), position, sampling_metrics(num_varied, size) | engine_metrics(
        c.engine)


def engine_metrics(engine) -> dict[str, float]:
    """What an engine in other processes reports (:class:`~jppo.rollout.vllm_remote.VLLMServers`): the last weight
    push's bytes, the policy version the step's rows were generated with (the pushes so far: every row of a batch
    has the same), and the run's server restarts and re-requested aborted rows so far."""
    names = {"push_bytes": "rollout/weight_push_bytes", "version": "rollout/policy_version",
             "restarts": "rollout/server_restarts", "aborted_rows": "rollout/aborted_rows"}
    return {metric: float(getattr(engine, name)) for name, metric in names.items() if hasattr(engine, name)}


def collect(
    c: Collector, state: RunState, timer: PhaseTimer, sampled: Optional[tuple] = None
) -> tuple[RunState, Experience, dict[str, float]]:
    """Step ``state.step + 1``'s experience (this process's rows), the state with the data position and KL
    controller advanced, and the rollout's metrics (whole batch, combined over processes). ``sampled``: the step's
    :func:`sample_and_score` result when it was generated already (off-policy steps, :mod:`jppo.run.offpolicy`);
    everything after it uses ``state``'s weights, the ones the update trains."""
    cfg, tokenizer = c.cfg, c.inputs.tokenizer
    step = int(state.step) + 1
    scored, data_position, sampling_metrics = sampled or sample_and_score(c, state, step, timer)
    exp, examples, prompts = scored.exp, scored.examples, scored.prompts
    row_examples, texts, finished, scores = scored.row_examples, scored.texts, scored.finished, scored.rewards
    reward_baselines = None
    if c.baseline_sampler is not None:
        with timer("reward_baseline"):
            reward_baselines = greedy_baselines(c, state, examples, prompts, exp.group_ids, step)
    mask, actor_cut = exp.response_mask, c.actor_cut
    source = c.old_log_prob_source  # update / rollout: no pass here (the update measures the mismatch)
    # the batch's tokens cross once for all forward passes, and not at all without one
    tokens = functools.cache(functools.partial(device_rows, exp, None, c.mesh))
    unreplayed = lambda: dataclasses.replace(tokens(), routed_experts=None)  # noqa: E731 (the reference: its own routing)
    if source == "recompute":
        with timer("old_log_prob"):
            exp = dataclasses.replace(exp, old_log_prob=forward_batch(
                c.log_probs_of, state.actor.weights, exp, c.mesh, rows=tokens(), **actor_cut))
    if c.ref_log_probs_of is not None:  # LoRA: the base weights with the adapters switched off
        with timer("ref_log_prob"):
            ref = c.ref_params if c.ref_params is not None else state.actor.frozen
            exp = dataclasses.replace(
                exp, ref_log_prob=forward_batch(c.ref_log_probs_of, ref, exp, c.mesh, rows=unreplayed(), **actor_cut)
            )
    elif c.ref_params is not None:
        with timer("ref_log_prob"):
            exp = dataclasses.replace(
                exp,
                ref_log_prob=forward_batch(c.log_probs_of, c.ref_params, exp, c.mesh, rows=unreplayed(), **actor_cut),
            )
    if state.critic is not None:
        with timer("values"):
            exp = dataclasses.replace(
                exp, values=forward_batch(c.values_of, state.critic.weights, exp, c.mesh, rows=tokens(), **c.critic_cut)
            )
    metrics: dict[str, float] = {}
    kl = state.kl
    with timer("advantages"):
        credits = c.inputs.credit_fn(texts, row_examples, finished) if c.inputs.credit_fn is not None else None
        rewards = place_rewards(exp, scores, finished, credits, tokenizer.decode)
        if cfg.algorithm.use_kl_in_reward:
            coef = float(np.asarray(kl.coef))
            old = exp.rollout_log_prob if source == "rollout" else exp.old_log_prob
            rewards, current_kl = kl_in_reward(
                rewards, old, exp.ref_log_prob, mask, kl_coef=coef, kind=cfg.algorithm.kl_penalty,
                mesh=c.mesh,
            )
            metrics["algorithm/kl_in_reward"] = current_kl
            metrics["algorithm/kl_coef"] = coef
            kl = c.kl_controller.update(kl, current_kl, len(prompts) * cfg.rollout.n)
        advantages, returns = compute_advantages(
            cfg.algorithm.adv_estimator, token_level_rewards=rewards, response_mask=mask, values=exp.values,
            group_ids=exp.group_ids, reward_baselines=reward_baselines, gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam, norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
            # bitwise: the whole batch on one device, the same program on any mesh
            place=functools.partial(on_one_device if cfg.trainer.deterministic == "bitwise" else on_mesh, mesh=c.mesh),
        )
    exp = dataclasses.replace(
        exp, token_rewards=np.asarray(rewards, np.float32), advantages=np.asarray(advantages, np.float32),
        returns=np.asarray(returns, np.float32),
    )
    metrics.update(rollout_metrics(exp, scores, cfg.rollout.max_response_length))
    metrics.update(sampling_metrics)
    if c.inputs.env_factory is not None:
        metrics.update(multi_turn_metrics(exp))
    if cfg.algorithm.overlong_filter:
        exp = overlong_filtered(exp, finished)
    exp, rejection_metrics = rejected_rows_cleared(exp, cfg.actor.rollout_correction)
    metrics.update(rejection_metrics)
    metrics.update(c.reward_failures())
    return advance(state, data_position=data_position, kl=kl), exp, metrics


def greedy_baselines(
    c: Collector, state: RunState, examples: list, prompts: list, group_ids: np.ndarray, step: int
) -> np.ndarray:
    """ReMax baselines: for every row, the reward of the current policy's greedy response to its prompt."""
    weights = c.sampling_weights(state.actor.weights)[0]
    greedy = sample(c.baseline_sampler, weights, prompts, state.key(step), examples)  # greedy: key unused
    greedy_scores = c.score_for_training(greedy, examples, prompts).rewards
    by_prompt = dict(zip(greedy.group_ids.tolist(), greedy_scores.tolist()))
    return np.asarray([by_prompt[i] for i in group_ids.tolist()], np.float32)


def decode_responses(batch: Experience, tokenizer: Tokenizer) -> tuple[list[str], list[bool]]:
    """Response texts (special tokens dropped; every response token, environment observations included) and
    whether each ended with one of the tokenizer's EOS ids (a single-turn response that did not was cut at the
    length limit; a multi-turn one may also have ended at the environment's word, :func:`truncated_rows`)."""
    texts, finished = [], []
    for ids, mask in zip(batch.response_ids, batch.response_attention.astype(bool)):
        tokens = ids[mask].tolist()
        finished.append(bool(tokens) and tokens[-1] in tokenizer.eos_ids)
        texts.append(tokenizer.decode(tokens))
    return texts, finished


def multi_turn_metrics(exp: Experience) -> dict[str, float]:
    """``multi_turn/observed_fraction``: responses holding an environment observation (a tool was called and
    answered); ``multi_turn/observation_tokens``: observation tokens per response. One process (multi-turn's)."""
    observation = exp.response_attention.astype(bool) & ~exp.response_mask.astype(bool)
    return {
        "multi_turn/observed_fraction": float(observation.any(axis=1).mean()),
        "multi_turn/observation_tokens": float(observation.sum(axis=1).mean()),
    }


def rollout_metrics(exp: Experience, scores: np.ndarray, max_length: int) -> dict[str, float]:
    """Whole-batch statistics of the rollout (token means over the response mask), combined over processes.
    ``perf/total_num_tokens`` counts prompt and response tokens (the loop also reports them per second)."""
    mask = exp.response_mask.astype(bool)
    lengths = exp.response_attention.sum(axis=1)
    token_sum = lambda x: np.where(mask, x, 0).sum(axis=1, dtype=np.float64)  # noqa: E731 (per row)
    # without an old-log-prob pass (actor.old_log_prob update or rollout) the update reports the gap itself
    measured = exp.old_log_prob is not None
    log_prob_gap = np.abs(exp.rollout_log_prob - exp.old_log_prob) if measured else np.zeros_like(exp.advantages)
    # per row, then over the global rows in order: the same bits on any number of processes
    sums = sum_over_rows(np.stack([
        np.ones(len(scores)), mask.sum(axis=1), scores, lengths, lengths >= max_length,
        token_sum(exp.advantages), token_sum(exp.returns), token_sum(log_prob_gap),
        np.zeros(len(scores)) if exp.values is None else token_sum(exp.values),
        exp.prompt_mask.sum(axis=1) + exp.response_attention.sum(axis=1),
    ], axis=1))
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
        "perf/total_num_tokens": sums[9],
    }
    if measured:  # agreement of the sampler's and the trainer's log-probs of the same tokens (should be ~0)
        out["rollout/log_prob_abs_diff"] = sums[7] / tokens
    if exp.values is not None:
        out["values/mean"] = sums[8] / tokens
    return {k: float(v) for k, v in out.items()}
