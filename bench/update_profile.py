"""Where jppo's update step is behind torch's at ``update_vs_torch``'s small size: the LM head's products timed
inside each compiled / eager step, side by side, with the same products run by themselves.

    python -m bench.update_profile [--quick] [--repeats N]

The step is :mod:`bench.update_vs_torch`'s ``small`` one (4 layers d512, vocabulary 32,768, 4 rows of 256 tokens:
T = 1,024) on both sides, from the same weights. Each side runs ``repeats`` times under its profiler, alternated
(jppo, torch, jppo, ...), after a warm-up:

- jppo: ``jax.profiler.trace`` of the compiled step; every thunk's span (start to result ready,
  :mod:`bench.hlo_profile`) attributed to a part by its instruction in the optimized HLO;
- torch: ``torch.profiler`` with shapes; the self CPU time of each ``aten::mm`` / ``addmm`` / ``bmm`` attributed
  by its operand shapes, and of every other op with a ``T x V`` operand to ``vocab_elementwise``.

Parts: ``forward`` (``h @ W``), ``grad_hidden`` (``dlogits @ W^T``), ``grad_weight`` (``h^T @ dlogits``),
``vocab_elementwise`` (softmax, log-softmax, entropy and their gradients over ``[T, V]``), ``rest``; per step,
medians over the repeats. ``standalone``: the three products as programs of their own (:mod:`bench.lm_head`'s),
timed side by side. ``grad_products_overlap``: seconds the two gradient products ran at the same time inside
XLA's step (its thunk executor starts independent thunks together; torch's autograd runs them one after the
other). The step rows are the unprofiled steps timed side by side (``update_vs_torch``'s ratio).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bench import hlo_profile, lm_head
from bench.actor_update import ActorUpdate, BatchShape, synthetic_batch
from bench.environment import match_torch_threads
from bench.timing import time_side_by_side
from bench.torch_decoder import TorchActorUpdate, TorchCausalLM
from bench.update_vs_torch import SIZES as UPDATE_SIZES, model_config
from jppo.core.settings import OptimConfig
from jppo.engine import ActorConfig

# quick: tokens, hidden, vocabulary and the MLP width all different, so every product is told apart by its sizes
SIZES = {"full": UPDATE_SIZES["full"]["small"],
         "quick": dict(layers=1, hidden=64, heads=4, kv_heads=2, vocab=512, batch=BatchShape(2, 16, 48))}
PRODUCTS = ("forward", "grad_hidden", "grad_weight")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def torch_part(name: str, shapes: list, tokens: int, hidden: int, vocab: int) -> str:
    """The part of the step one torch op is, from its name and operand shapes (see the module docstring)."""
    arrays = [list(s) for s in shapes if isinstance(s, (list, tuple)) and s and all(isinstance(d, int) for d in s)]
    if name in MATMULS and len(arrays) >= 2:
        lhs, rhs = arrays[-2], arrays[-1]
        part = hlo_profile.product_part(lhs[-1], int(np.prod(lhs[:-1])) * rhs[-1], tokens, hidden, vocab)
        if part is not None:
            return part
    if any(int(np.prod(s)) == tokens * vocab and vocab in s for s in arrays):
        return "vocab_elementwise"
    return "rest"


def profile_torch(step, dims: tuple[int, int, int]) -> dict[str, float]:
    """Seconds per part of one torch step (self CPU time of its ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    seconds = dict.fromkeys((*hlo_profile.HEAD_PARTS, "rest"), 0.0) | {"profiled_step": wall}
    for event in prof.events():
        seconds[torch_part(event.name, event.input_shapes or [], *dims)] += event.self_cpu_time_total / 1e6
    return seconds


def profile_jax(step, hlo_text: str, dims: tuple[int, int, int]) -> dict[str, float]:
    """Seconds per part of one jppo step (thunk spans, :mod:`bench.hlo_profile`)."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            start = time.perf_counter()
            step()
            wall = time.perf_counter() - start
        profile = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    thunks = hlo_profile.spans(hlo_profile.trace_events(profile))
    return hlo_profile.head_seconds(thunks, hlo_text, *dims) | {"profiled_step": wall}


def compiled_text(update: ActorUpdate) -> str:
    """The optimized HLO of ``update``'s jitted step (after its first call)."""
    jitted = update._step._jitted  # noqa: SLF001 - the benchmark reads the program the trainer runs
    state = update.state
    with jax.set_mesh(update._step._mesh):  # noqa: SLF001
        return jitted.lower(state.replace(frozen=None), state.frozen, update._arrays).compile().as_text()


def standalone(dims: tuple[int, int, int], repeats: int) -> dict[str, dict[str, float]]:
    """The three head products as programs of their own (:mod:`bench.lm_head`), median seconds per side."""
    tokens, hidden, vocab = dims
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(hidden, vocab)) * 0.02, jnp.float32)
    g = jnp.asarray(rng.normal(size=(tokens, vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)
    ours, theirs = lm_head.jax_candidates(h, w, g, targets), lm_head.torch_candidates(h, w, g, targets)
    out = {}
    for name in PRODUCTS:
        timings = time_side_by_side({"jax": ours[name][0], "torch": theirs[name]}, repeats)
        out[name] = {side: timing.median_s for side, timing in timings.items()}
    return out


def measure(quick: bool, repeats: int) -> dict:
    size = SIZES["quick" if quick else "full"]
    cfg, shape = model_config(size), size["batch"]
    dims = (shape.tokens, cfg.hidden_size, cfg.vocab_size)
    threads = match_torch_threads()
    batch = synthetic_batch(shape, cfg.vocab_size, ragged=False)
    actor_cfg = ActorConfig(ppo_mini_batch_size=shape.rows, ppo_micro_batch_size=shape.rows, optim=OptimConfig(lr=1e-5))
    ours = ActorUpdate(cfg, actor_cfg, batch)
    theirs = TorchActorUpdate(TorchCausalLM.from_jppo(cfg, ours.host_params()), batch, actor_cfg, "cpu")
    ours(), theirs()  # warm-up (jppo's compiles)
    text = compiled_text(ours)
    profiled: dict[str, list[dict[str, float]]] = {"jax": [], "torch": []}
    for _ in range(repeats):  # alternated
        profiled["jax"].append(profile_jax(ours, text, dims))
        profiled["torch"].append(profile_torch(theirs, dims))
    steps = time_side_by_side({"jax": ours, "torch": theirs}, repeats)
    parts = {side: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for side, runs in profiled.items()}
    return {
        "size": {"tokens": dims[0], "hidden": dims[1], "vocab": dims[2], "layers": cfg.num_layers},
        "torch_threads": threads, "repeats": repeats, "parts_s": parts,
        "standalone_s": standalone(dims, repeats),
        "step_s": {side: timing.median_s for side, timing in steps.items()},
        "emitters": lm_head.emitters(text), "load_average_1m": os.getloadavg()[0],
    }


def _ratio(torch_s: float, jax_s: float) -> str:
    return f"{torch_s / jax_s:.2f}" if jax_s > 0 else "n/a"


def table(result: dict) -> str:
    """The parts side by side: seconds per step and torch / jppo (above 1: jppo faster)."""
    jax_parts, torch_parts = result["parts_s"]["jax"], result["parts_s"]["torch"]
    lines = ["| part | jppo in step s | torch in step s | torch / jppo | jppo standalone s | torch standalone s |",
             "|---|---:|---:|---:|---:|---:|"]
    for part in (*hlo_profile.HEAD_PARTS, "rest"):
        alone = result["standalone_s"].get(part)
        cells = [f"{jax_parts[part]:.4f}", f"{torch_parts[part]:.4f}", _ratio(torch_parts[part], jax_parts[part])]
        cells += [f"{alone['jax']:.4f}", f"{alone['torch']:.4f}"] if alone else ["", ""]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    step = result["step_s"]
    lines.append(f"| whole step (unprofiled) | {step['jax']:.4f} | {step['torch']:.4f} | "
                 f"{_ratio(step['torch'], step['jax'])} | | |")
    lines.append(f"| profiled step (wall) | {jax_parts['profiled_step']:.4f} | {torch_parts['profiled_step']:.4f} | "
                 f"{_ratio(torch_parts['profiled_step'], jax_parts['profiled_step'])} | | |")
    lines.append(f"\nInside XLA's step the two gradient products of the head ran at the same time for "
                 f"{jax_parts['grad_products_overlap']:.4f} s per step (their spans each include it); some thunk ran "
                 f"for {jax_parts['covered']:.4f} s of the profiled step's {jax_parts['profiled_step']:.4f} s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.update_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="profiled steps per side (default 3)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        print(f"bench.update_profile: error: --repeats={args.repeats} must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = measure(args.quick, args.repeats)
    result["wall_s"] = time.perf_counter() - started
    print(table(result))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
