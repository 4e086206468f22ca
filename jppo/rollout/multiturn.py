"""Multi-turn rollouts: model turns and environment observations alternate in one response.

For every response row, on the host, with the fixed-shape KV-cache sampler run once per turn over all rows:

1. the row's context is its prompt plus the observation of ``env.reset`` (all of it is the row's prompt, and
   ``data.max_prompt_length`` bounds all of it: every length the config was checked against assumes so);
2. turn ``t`` (key ``fold_in(key, t)``) re-prefills each live row's context (prompt + response so far) and samples
   until EOS or one of the environment's ``stop`` tokens; the turn's tokens join the response (loss mask 1, the
   sampler's log-probs), cut to what is left of ``rollout.max_response_length``;
3. a turn that ended at EOS or a stop token goes to ``env.step``: its reward is put on the turn's last token; its
   observation's tokens join the response with loss mask 0 (attended by the model, in no loss term, log-prob 0)
   when the row goes on: not ``done``, the turn did not end at EOS, turns remain, and at least one response slot
   would be left after it;
4. a row ends at ``done``, EOS, a turn cut by the length limit, or after ``rollout.max_turns`` model turns.

A row is ``truncated`` (what ``algorithm.overlong_filter`` masks) when the length limit ended it before the episode
did: its last turn was cut by ``rollout.max_response_length``, or the environment went on but its observation
left no slot for the next turn. An episode ended by ``done``, by EOS or by ``rollout.max_turns`` is not truncated:
the turn limit is a rule of the episode like ``done``, and its reward says what the model did with its turns (a
policy that keeps calling tools must see that this scores nothing), whereas a length cut hides an answer the model
was still writing.

So ``response_attention`` covers the whole response (contiguous) and ``response_mask`` only the model's tokens:
environment tokens change the loss normalizers (N tokens of the mini-batch) nowhere, and the advantage estimators
skip them (:mod:`jppo.advantages.returns`). Rows of one prompt are sampled separately (no shared prefill).
One process only: each row's context lives on the host that sampled it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from jppo.core.errors import ConfigError
from jppo.core.experience import Experience
from jppo.rollout.env import KEY, EnvFactory, Environment
from jppo.rollout.sampler import pad_prompts

# (contexts, turn) -> per row, the turn's sampled tokens and their log-probs
TurnSampler = Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]]]]


@dataclasses.dataclass
class Trajectory:
    """One row being built: its prompt and the response so far, with a loss flag, a log-prob and a reward per token."""

    prompt: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    from_model: list[bool] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # response position -> env reward
    done: bool = False
    truncated: bool = False  # ended by the length limit before the episode ended (module docstring)
    turns: int = 0

    def add(self, ids: Sequence[int], from_model: bool, log_probs: Sequence[float] | None = None) -> None:
        self.ids.extend(int(t) for t in ids)
        self.from_model.extend([from_model] * len(ids))
        self.log_probs.extend([float(x) for x in log_probs] if log_probs is not None else [0.0] * len(ids))


def take_turn(
    traj: Trajectory, env: Environment, tokens: Sequence[int], log_probs: Sequence[float], *, tokenizer,
    stop_ids: tuple[int, ...], max_turns: int, max_length: int,
) -> None:
    """Adds one sampled model turn to ``traj`` and the environment's answer to it (rules in the module docstring)."""
    room = max_length - len(traj.ids)
    tokens, log_probs = list(tokens)[:room], list(log_probs)[:room]
    traj.turns += 1
    traj.add(tokens, True, log_probs)
    ended_eos = bool(tokens) and tokens[-1] in tokenizer.eos_ids
    ended_stop = bool(tokens) and tokens[-1] in stop_ids and not ended_eos
    if not (ended_eos or ended_stop):  # cut by the length limit: no complete action
        traj.done = traj.truncated = True
        return
    observation, reward, done = env.step(tokenizer.decode(tokens))
    traj.rewards[len(traj.ids) - 1] = traj.rewards.get(len(traj.ids) - 1, 0.0) + float(reward)
    observed = tokenizer.encode(observation, add_special_tokens=False) if observation else []
    if done or ended_eos or traj.turns >= max_turns:
        traj.done = True
        return
    if len(traj.ids) + len(observed) >= max_length:  # the episode goes on, the response has no room for it
        traj.done = traj.truncated = True
        return
    traj.add(observed, False)


def longest_context(max_prompt_tokens: int, max_length: int) -> int:
    """The most tokens a turn can start from (a row's prompt, ``env.reset``'s observation included, plus its
    response so far): ``max_prompt_tokens + max_length - 1``, since a row takes another turn only while at least
    one of its ``max_length`` response slots is left (:func:`take_turn`)."""
    return max_prompt_tokens + max_length - 1


def run_turns(
    sample_turn: TurnSampler, trajectories: list[Trajectory], envs: list[Environment], *, tokenizer,
    stop_ids: tuple[int, ...], max_turns: int, max_length: int,
) -> list[Trajectory]:
    """Alternates model turns (``sample_turn`` over every row; finished rows get a one-token dummy context whose
    sample is ignored, so the batch keeps its shape) and environment steps until every row is done."""
    for turn in range(max_turns):
        live = [not traj.done for traj in trajectories]
        if not any(live):
            break
        contexts = [traj.prompt + traj.ids if alive else [tokenizer.pad_id] for traj, alive in zip(trajectories, live)]
        tokens, log_probs = sample_turn(contexts, turn)
        for traj, env, alive, ids, lps in zip(trajectories, envs, live, tokens, log_probs):
            if alive:
                take_turn(traj, env, ids, lps, tokenizer=tokenizer, stop_ids=stop_ids, max_turns=max_turns,
                          max_length=max_length)
    return trajectories


def reset_prompt(prompt: Sequence[int], observed: Sequence[int], *, max_prompt_length: int, env: str,
                 example) -> list[int]:
    """The row's prompt after ``env.reset``: ``prompt`` plus the reset observation's tokens ``observed``. It must
    fit ``data.max_prompt_length``: the sequence bounds the config was checked against (``ppo_max_token_len`` of
    token-budget micro-batching, the memory plan) are ``max_prompt_length + rollout.max_response_length``, and a
    longer prompt would break them in the middle of a run. A one-line :class:`ConfigError` otherwise."""
    if len(prompt) + len(observed) > max_prompt_length:
        raise ConfigError(
            f"{KEY}={env!r}: reset on the prompt {example.prompt[:40]!r} returned a {len(observed)}-token observation, "
            f"so the prompt is {len(prompt)} + {len(observed)} = {len(prompt) + len(observed)} tokens > "
            f"data.max_prompt_length={max_prompt_length}; the limit bounds the prompt with its reset observation: "
            "raise it or shorten the observation"
        )
    return list(prompt) + list(observed)


def to_experience(trajectories: list[Trajectory], group_ids: np.ndarray, *, pad_id: int, max_length: int,
                  bucket: int) -> Experience:
    """The rows as an ``Experience``: left-padded prompts, responses of ``max_length`` slots; ``response_mask`` on
    model tokens, ``response_attention`` on all, the env's rewards in ``token_rewards``, ``truncated`` per row."""
    prompt_ids, prompt_mask = pad_prompts([t.prompt for t in trajectories], pad_id, multiple=bucket)
    rows = len(trajectories)
    ids = np.full((rows, max_length), pad_id, np.int32)
    mask = np.zeros((rows, max_length), bool)
    attention = np.zeros((rows, max_length), bool)
    log_probs = np.zeros((rows, max_length), np.float32)
    rewards = np.zeros((rows, max_length), np.float32)
    for row, traj in enumerate(trajectories):
        width = len(traj.ids)
        ids[row, :width] = traj.ids
        mask[row, :width] = traj.from_model
        attention[row, :width] = True
        log_probs[row, :width] = traj.log_probs
        for position, reward in traj.rewards.items():
            rewards[row, position] = reward
    return Experience(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=mask,
        response_attention=attention, rollout_log_prob=log_probs, token_rewards=rewards,
        group_ids=np.asarray(group_ids, np.int64), truncated=np.asarray([t.truncated for t in trajectories], bool),
    )


class MultiTurnSampler:
    """``sampler`` (``n = 1``, stopping at EOS and the env's stop tokens) driven turn by turn over ``n`` rows per
    prompt; called like :class:`jppo.rollout.Sampler` plus the prompts' examples (for ``env.reset``)."""

    def __init__(self, sampler, env_factory: EnvFactory, tokenizer, *, n: int, stop_ids: tuple[int, ...],
                 max_turns: int, max_length: int, bucket: int, max_prompt_length: int, env: str):
        """``max_prompt_length``: the bound of a prompt with its reset observation (:func:`reset_prompt`);
        ``env``: the environment as ``rollout.env`` names it (for messages)."""
        if jax.process_count() > 1:
            raise ValueError("rollout.env (multi-turn rollouts) runs in one process only")
        self.sampler, self.env_factory, self.tokenizer = sampler, env_factory, tokenizer
        self.n, self.stop_ids, self.max_turns, self.max_length, self.bucket = n, stop_ids, max_turns, max_length, bucket
        self.max_prompt_length, self.env = max_prompt_length, env

    def __call__(self, params, prompts: list[list[int]], key: jax.Array, examples: list) -> Experience:
        group_ids = np.repeat(np.arange(len(prompts)), self.n)
        envs = [self.env_factory() for _ in group_ids]
        trajectories = []
        for env, group in zip(envs, group_ids.tolist()):
            observed = env.reset(examples[group].prompt, examples[group])
            extra = self.tokenizer.encode(observed, add_special_tokens=False) if observed else []
            prompt = reset_prompt(prompts[group], extra, max_prompt_length=self.max_prompt_length, env=self.env,
                                  example=examples[group])
            trajectories.append(Trajectory(prompt=prompt))

        def sample_turn(contexts: list[list[int]], turn: int):
            exp = self.sampler(params, contexts, jax.random.fold_in(key, turn))
            masks = exp.response_mask.astype(bool)
            return ([ids[m].tolist() for ids, m in zip(exp.response_ids, masks)],
                    [lp[m].tolist() for lp, m in zip(exp.rollout_log_prob, masks)])

        run_turns(sample_turn, trajectories, envs, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                  max_turns=self.max_turns, max_length=self.max_length)
        return to_experience(trajectories, group_ids, pad_id=self.tokenizer.pad_id, max_length=self.max_length,
                             bucket=self.bucket)
