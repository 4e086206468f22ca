"""``Experience``: everything one training step collects for learning, as one typed pytree.

Rows are sequences (prompt + one response), prompt-major (the ``rollout.n`` responses of a prompt are adjacent).
Token arrays and masks are always present; the rest is filled in as collection proceeds (sampler log-probs, then
old/ref log-probs and values from forward passes, then rewards, advantages and returns). A field that a run does
not produce (no critic: ``values``; no reference: ``ref_log_prob``) is ``None``, an empty subtree to ``jax.tree``.

Every per-token field is response-aligned ``[N, L]``: column ``j`` is response token ``j``. Micro-batching cuts an
``Experience`` generically: the rows of every present field move together (:meth:`Experience.take`,
``jax.tree.map``), and the per-token fields travel into the losses as the ``slots`` of
:class:`jppo.engine.microbatch.MicroBatches`, an ``Experience`` whose per-token arrays are ``[K, D, S, L]`` and whose
token arrays are ``None`` (the model reads packed token rows instead).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

Array = np.ndarray | jax.Array

# what the model reads: the token rows (and, with routing replay, each token's recorded experts)
TOKEN_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_attention", "routed_experts")
ROW_FIELDS = ("group_ids", "truncated")  # per-row facts the host uses and the devices never read
PER_TOKEN_FIELDS = (
    "response_mask", "rollout_log_prob", "old_log_prob", "ref_log_prob", "values", "token_rewards", "advantages",
    "returns",
)


@dataclasses.dataclass(frozen=True)
class Experience:
    """A batch of sequences and what is known about each of their response tokens.

    Attributes:
        prompt_ids: ``[N, P]`` left-padded prompts.
        prompt_mask: ``[N, P]`` real prompt tokens (left-padded: each row's real tokens end at column P - 1).
        response_ids: ``[N, L]`` responses, padded on the right.
        response_mask: ``[N, L]`` tokens the losses count (may have holes, e.g. tool observations).
        response_attention: ``[N, L]`` response tokens that exist (the model sees them), contiguous from column 0;
            defaults to every position up to the last ``response_mask`` token.
        rollout_log_prob: ``[N, L]`` the sampler's log-probs of its tokens.
        old_log_prob: ``[N, L]`` the policy's log-probs before this step's updates (the PPO ratio's denominator).
        ref_log_prob: ``[N, L]`` the reference policy's log-probs (KL loss, KL in the reward).
        values: ``[N, L]`` the critic's value before each response token.
        token_rewards: ``[N, L]`` per-token rewards (the outcome on the last token, dense credit, minus KL).
        advantages: ``[N, L]``.
        returns: ``[N, L]`` the critic's regression targets.
        group_ids: ``[N]`` which prompt each row answers (rows of a group share a baseline).
        routed_experts: ``[N, P + L, Ls, k]`` with routing replay (a model with experts, ``actor.routing_replay``):
            the experts the sampler chose for each token (prompt columns, then response columns) at each of the
            ``Ls`` layers with experts, which the policy's forward passes route by (:mod:`jppo.rollout.routing`).
        truncated: ``[N]`` rows cut by ``rollout.max_response_length`` before they ended, as a multi-turn rollout
            decides (:mod:`jppo.rollout.multiturn`); ``None`` for a single-turn batch, whose rows end at EOS or
            at the limit. Like ``group_ids`` a host-side fact of the row: it never goes to the devices.
    """

    prompt_ids: Optional[Array] = None
    prompt_mask: Optional[Array] = None
    response_ids: Optional[Array] = None
    response_mask: Optional[Array] = None
    response_attention: Optional[Array] = None
    rollout_log_prob: Optional[Array] = None
    old_log_prob: Optional[Array] = None
    ref_log_prob: Optional[Array] = None
    values: Optional[Array] = None
    token_rewards: Optional[Array] = None
    advantages: Optional[Array] = None
    returns: Optional[Array] = None
    group_ids: Optional[Array] = None
    truncated: Optional[Array] = None
    routed_experts: Optional[Array] = None

    def __post_init__(self) -> None:
        # Host batches (numpy) are checked when made; the same type inside jit (tracers) or as micro-batch slots
        # (token arrays None) is not.
        if all(isinstance(getattr(self, name), np.ndarray) for name in ("prompt_ids", "response_ids", "response_mask")):
            _check_host_batch(self)

    @property
    def num_sequences(self) -> int:
        return self.response_mask.shape[0]

    def lengths(self) -> np.ndarray:
        """Real tokens of each sequence: prompt tokens plus existing response tokens."""
        return self.prompt_mask.sum(-1) + self.response_attention.sum(-1)

    def take(self, rows: np.ndarray) -> "Experience":
        """The sub-batch of the given rows, in that order (every present field)."""
        return jax.tree.map(lambda x: x[rows], self)

    def per_token(self) -> "Experience":
        """Only the response-aligned ``[N, L]`` fields (what micro-batching carries into the losses' slots)."""
        return dataclasses.replace(self, **{name: None for name in TOKEN_FIELDS + ROW_FIELDS})

    def keep_per_token(self, names: tuple[str, ...]) -> "Experience":
        """The same batch carrying only the per-token fields ``names`` (plus the response mask) besides its tokens,
        and no row fields (what the devices are sent)."""
        unknown = set(names) - set(PER_TOKEN_FIELDS)
        if unknown:
            raise ValueError(f"not per-token fields of Experience: {sorted(unknown)}")
        dropped = [name for name in PER_TOKEN_FIELDS if name not in names and name != "response_mask"]
        return dataclasses.replace(self, **{name: None for name in dropped + list(ROW_FIELDS)})


jax.tree_util.register_dataclass(
    Experience, data_fields=[f.name for f in dataclasses.fields(Experience)], meta_fields=[]
)


def _check_host_batch(exp: Experience) -> None:
    """Shapes agree, and the layout the fixed micro-batches assume holds (one-line errors)."""
    n, p = exp.prompt_ids.shape
    length = exp.response_ids.shape[1]
    for name, shape in (("prompt_mask", (n, p)), ("response_ids", (n, length)), ("response_mask", (n, length))):
        array = getattr(exp, name)
        if array is None or array.shape != shape:
            raise ValueError(f"{name} has shape {None if array is None else array.shape}, expected {shape}")
    if exp.response_attention is None:
        mask = exp.response_mask.astype(bool)
        last = np.where(mask.any(-1), length - np.argmax(mask[:, ::-1], axis=-1), 0)
        object.__setattr__(exp, "response_attention", np.arange(length)[None, :] < last[:, None])
    for name in PER_TOKEN_FIELDS[1:] + ("response_attention",):
        array = getattr(exp, name)
        if array is not None and array.shape != (n, length):
            raise ValueError(f"per-token array {name!r} has shape {array.shape}, expected {(n, length)}")
    routed = exp.routed_experts
    if routed is not None and (routed.ndim != 4 or routed.shape[:2] != (n, p + length)):
        raise ValueError(f"routed_experts has shape {routed.shape}, expected {(n, p + length)} + (layers, k)")
    for name in ROW_FIELDS:
        array = getattr(exp, name)
        if array is not None and array.shape != (n,):
            raise ValueError(f"{name} has shape {array.shape}, expected {(n,)}")
    if np.any(exp.response_mask.astype(bool) & ~exp.response_attention.astype(bool)):
        raise ValueError("response_mask marks tokens that response_attention says do not exist")
    # The fixed layout puts the response right after the prompt's last column and predicts response token j at
    # column P - 1 + j: padding between prompt and response, or inside the response, would shift every
    # prediction (the packed layout would not notice). Loss-mask holes (response_mask) are fine.
    prompt = exp.prompt_mask.astype(bool)
    bad = np.flatnonzero(np.any(prompt[:, :-1] & ~prompt[:, 1:], axis=1))
    if bad.size:
        raise ValueError(f"prompt_mask row {bad[0]} is not left-padded: prompts must end at the last column")
    attention = exp.response_attention.astype(bool)
    bad = np.flatnonzero(np.any(~attention[:, :-1] & attention[:, 1:], axis=1))
    if bad.size:
        raise ValueError(
            f"response_attention row {bad[0]} has a gap: a response's tokens must be contiguous from column 0 "
            "(mask out tokens the loss skips with response_mask instead)"
        )
    if np.any(exp.prompt_mask.sum(-1) == 0):
        raise ValueError(
            "every sequence needs at least one prompt token (the first response token is predicted from it)"
        )
