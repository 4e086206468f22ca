"""The LM head of the actor update, operation by operation, against torch: where ``update_vs_torch_small`` loses.

    python -m bench.lm_head [--quick] [--repeats N]

At the ``small`` size of :mod:`bench.update_vs_torch` (T = 4 x 256 = 1,024 tokens, hidden 512, vocabulary 32,768)
the LM head's three products are 3 x 2 x T x H x V = 103 GFLOP of the step's ~150, so the head decides the ratio.
Each candidate below is timed against its torch eager twin, side by side (:func:`bench.timing.time_side_by_side`),
float32, torch with as many threads as XLA's CPU pool:

- ``forward``: ``logits = h @ W`` (``[T, H] x [H, V]``);
- ``grad_hidden``: ``dlogits @ W^T`` (``[T, V] x [V, H]``, the right operand transposed);
- ``grad_weight``: ``h^T @ dlogits`` (``[H, T] x [T, V]``, the left operand transposed);
- ``softmax_grad``: ``softmax(logits) - onehot(target)`` over ``[T, V]`` (memory-bound: 128 MiB in, 128 MiB out);
- ``head_block``: the whole head forward and backward: logits, ``logsumexp``, the target's logit
  (:func:`jppo.models.log_probs.select_target`), the gradients of the log-prob sum w.r.t. ``h`` and ``W``;
  torch: ``linear``, ``log_softmax``, ``gather``, ``backward``; ``head_block_with_entropy``: the same plus the
  stop-gradient token entropy the actor's loss always computes for ``actor/entropy`` (one more pass over
  ``[T, V]``), as jppo's step runs it (torch's twin of ``update_vs_torch`` computes no entropy: the same torch block);
- ``step``: ``update_vs_torch``'s whole small step on both sides, and the step minus its head block (the layers,
  the loss and AdamW), so the head's share of the gap is read off one run.

For each XLA program it also reports how XLA:CPU emits its products (``emitters``): ``ynn`` (a
``__ynn_fusion``, the YNNPACK library kernel) or ``dot`` (a plain HLO ``dot``, XLA:CPU's own Eigen-based
contraction). In the compiled update step of that size (its optimized HLO, ``compiled.as_text()``) the forward and
``grad_hidden`` products are YNN fusions and ``grad_weight`` is a plain ``dot`` contracting both operands over
their dimension 0, as the standalone programs here. Ratios are torch seconds over JAX seconds: above 1, JAX is
faster.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bench.environment import match_torch_threads
from bench.timing import time_side_by_side
from jppo.losses.entropy import entropy_from_logits
from jppo.models.log_probs import select_target

SIZES = {"full": dict(tokens=1024, hidden=512, vocab=32768), "quick": dict(tokens=64, hidden=32, vocab=512)}


def emitters(compiled_text: str) -> dict[str, int]:
    """How many products of a compiled XLA:CPU program are YNNPACK fusions and how many plain ``dot`` ops."""
    ynn = len(re.findall(r"= \S+ fusion\([^\n]*__ynn_fusion", compiled_text))
    ynn_dots = sum(1 for body in re.findall(r"fused_computation[\w.]* \([^\n]*\{\n(.*?)\n\}", compiled_text, re.S)
                   if " dot(" in body)
    plain = len(re.findall(r"^\s*(?:ROOT )?%[\w.\-]+ = \S+ dot\(", compiled_text, re.M))
    return {"ynn_fusions": ynn, "dots_inside_fusions": ynn_dots, "plain_dots": plain - ynn_dots}


def jax_candidates(h, w, g, targets) -> dict:
    """Jitted JAX programs, each returning a callable that blocks on its result, and their compiled HLO text."""

    def block(h, w):
        def log_prob_sum(h, w):
            logits = h @ w
            return jnp.sum(select_target(logits, targets) - jax.nn.logsumexp(logits, axis=-1))

        return jax.grad(log_prob_sum, argnums=(0, 1))(h, w)

    def block_with_entropy(h, w):  # as the actor's loss computes it: the entropy metric, stop-gradient
        def log_prob_sum(h, w):
            logits = h @ w
            entropy = jax.lax.stop_gradient(entropy_from_logits(logits))
            return jnp.sum(select_target(logits, targets) - jax.nn.logsumexp(logits, axis=-1)), jnp.sum(entropy)

        return jax.grad(log_prob_sum, argnums=(0, 1), has_aux=True)(h, w)

    def softmax_grad(logits):
        probs = jax.nn.softmax(logits, axis=-1)
        index = jax.lax.broadcasted_iota(targets.dtype, logits.shape, 1)
        return probs - (index == targets[:, None]).astype(logits.dtype)

    programs = {
        "forward": (lambda h, w: h @ w, (h, w)),
        "grad_hidden": (lambda g, w: g @ w.T, (g, w)),
        "grad_weight": (lambda h, g: h.T @ g, (h, g)),
        "softmax_grad": (softmax_grad, (g,)),
        "head_block": (block, (h, w)),
        "head_block_with_entropy": (block_with_entropy, (h, w)),
    }
    out = {}
    for name, (fn, args) in programs.items():
        compiled = jax.jit(fn).lower(*args).compile()
        out[name] = (lambda c=compiled, a=args: jax.block_until_ready(c(*a)), compiled.as_text())
    return out


def torch_candidates(h, w, g, targets) -> dict:
    th, tw, tg, tt = (torch.from_numpy(np.array(x)) for x in (h, w, g, targets))

    def block():
        hh, ww = th.clone().requires_grad_(True), tw.clone().requires_grad_(True)
        logits = hh @ ww
        logits.log_softmax(-1).gather(-1, tt.long()[:, None]).sum().backward()
        return hh.grad, ww.grad

    def softmax_grad():
        out = tg.softmax(-1)
        out[torch.arange(out.shape[0]), tt.long()] -= 1.0
        return out

    with torch.no_grad():
        plain = {"forward": lambda: th @ tw, "grad_hidden": lambda: tg @ tw.t(), "grad_weight": lambda: th.t() @ tg}
    return plain | {"softmax_grad": softmax_grad, "head_block": block, "head_block_with_entropy": block}


def measure(quick: bool, repeats: int) -> dict:
    size = SIZES["quick" if quick else "full"]
    rng = np.random.default_rng(0)
    t, hd, v = size["tokens"], size["hidden"], size["vocab"]
    h = jnp.asarray(rng.normal(size=(t, hd)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(hd, v)) * 0.02, jnp.float32)
    g = jnp.asarray(rng.normal(size=(t, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, t), jnp.int32)
    threads = match_torch_threads()
    ours, theirs = jax_candidates(h, w, g, targets), torch_candidates(h, w, g, targets)
    flops = {"forward": 2 * t * hd * v, "grad_hidden": 2 * t * hd * v, "grad_weight": 2 * t * hd * v,
             "head_block": 6 * t * hd * v}
    result = {"size": size, "torch_threads": threads, "ops": {}}
    for name in ours:
        timings = time_side_by_side({"jax": ours[name][0], "torch": theirs[name]}, repeats)
        entry = {side: timing.median_s for side, timing in timings.items()}
        entry["torch_over_jax"] = entry["torch"] / entry["jax"]
        if name in flops:
            entry["gflops"] = {side: flops[name] / entry[side] / 1e9 for side in ("jax", "torch")}
        entry["emitters"] = emitters(ours[name][1])
        result["ops"][name] = entry
    if not quick:
        result["step"] = whole_steps(repeats)
    return result


def whole_steps(repeats: int) -> dict:
    """``update_vs_torch``'s small step on both sides (its own candidates), for the head's share of each step."""
    from bench.actor_update import ActorUpdate, synthetic_batch
    from bench.torch_decoder import TorchActorUpdate, TorchCausalLM
    from bench.update_vs_torch import SIZES as UPDATE_SIZES, model_config
    from jppo.core.settings import OptimConfig
    from jppo.engine import ActorConfig

    size = UPDATE_SIZES["full"]["small"]
    cfg, shape = model_config(size), size["batch"]
    batch = synthetic_batch(shape, cfg.vocab_size, ragged=False)
    actor_cfg = ActorConfig(ppo_mini_batch_size=shape.rows, ppo_micro_batch_size=shape.rows, optim=OptimConfig(lr=1e-5))
    ours = ActorUpdate(cfg, actor_cfg, batch)
    theirs = TorchActorUpdate(TorchCausalLM.from_jppo(cfg, ours.host_params()), batch, actor_cfg, "cpu")
    timings = time_side_by_side({"jax": ours, "torch": theirs}, repeats)
    return {side: timing.median_s for side, timing in timings.items()}


def table(result: dict) -> str:
    lines = ["| op | JAX s | torch s | torch / JAX | GFLOP/s JAX, torch | XLA emitters |", "|---|---:|---:|---:|---:|---|"]
    for name, e in result["ops"].items():
        rates = ", ".join(f"{x:.1f}" for x in e["gflops"].values()) if "gflops" in e else ""
        emit = ", ".join(f"{k} {n}" for k, n in e["emitters"].items() if n)
        lines.append(f"| {name} | {e['jax']:.4f} | {e['torch']:.4f} | {e['torch_over_jax']:.2f} | {rates} | {emit} |")
    if "step" in result:
        step, ops = result["step"], result["ops"]
        rest = {side: step[side] - ops["head_block_with_entropy" if side == "jax" else "head_block"][side]
                for side in ("jax", "torch")}
        lines.append(f"| whole step (update_vs_torch small) | {step['jax']:.4f} | {step['torch']:.4f} | "
                     f"{step['torch'] / step['jax']:.2f} | | |")
        lines.append(f"| step minus head block (JAX with entropy) | {rest['jax']:.4f} | {rest['torch']:.4f} | "
                     f"{rest['torch'] / rest['jax']:.2f} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lm_head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    result = measure(args.quick, args.repeats)
    print(table(result))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
