"""Peak memory of one actor update step with a 32k vocabulary at T = 1024: chunked log-probs vs full logits.

    python -m bench.memory [--quick]

jppo computes log-probs over sequence chunks of ``log_prob_chunk_size`` positions under ``jax.checkpoint``, so
neither the forward nor the backward pass holds the ``[B, T, V]`` float32 logits. "Full logits" is the same step
with one chunk as long as the row (``log_prob_chunk_size = T``): the whole logits array exists at once, as in an
implementation that projects every position and then takes a log-softmax.

Each variant runs in a fresh Python process (``--child``), so neither inherits the other's allocations; the two
run at the same time, since only memory is measured. Each reports:

- ``peak_rss_bytes``: ``resource.getrusage`` max RSS of the whole process (Python, jax, compilation, the step);
- ``step_rss_increase_bytes``: that peak minus the RSS just before the step ran (0 when compilation peaked higher);
- ``xla_temp_bytes``: the compiled step's temporary buffers, from XLA's ``memory_analysis()`` (exact, noise-free),
  with ``xla_argument_bytes`` and ``xla_output_bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
from typing import Callable

import jax
from flax import nnx

from bench.actor_update import BatchShape, synthetic_batch
from bench.report import section
from jppo.engine import ActorConfig, actor_loss_fn, init_train_state, make_update_step
from jppo.engine.layout import place
from jppo.parallel.mesh import make_mesh
from jppo.engine.microbatch import make_micro_batches
from jppo.models import CausalLM, ModelConfig, create_model

SIZES = {
    "full": dict(vocab=32768, hidden=256, layers=2, heads=4, kv_heads=2, rows=2, prompt=128, response=896),
    "quick": dict(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2, rows=2, prompt=32, response=96),
}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _current_rss_bytes() -> int:
    with open("/proc/self/statm", encoding="utf-8") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(spec: dict) -> dict:
    """Compiles and runs one actor update step as ``spec`` describes; returns its memory figures."""
    shape = BatchShape(spec["rows"], spec["prompt"], spec["response"])
    model_cfg = ModelConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=4 * spec["hidden"],
        num_layers=spec["layers"], num_heads=spec["heads"], num_kv_heads=spec["kv_heads"], model_type="qwen2",
    )
    cfg = ActorConfig(ppo_mini_batch_size=shape.rows, ppo_micro_batch_size=shape.rows, log_prob_chunk_size=spec["chunk"],
                      loss_scale_factor=float(shape.response))
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, params = nnx.split(create_model(CausalLM, model_cfg, mesh), nnx.Param)
    state = init_train_state(params, cfg, mesh)
    batch = synthetic_batch(shape, model_cfg.vocab_size, ragged=False)
    arrays = place(make_micro_batches(batch, 1, micro_batch_size=shape.rows).device_arrays(), mesh)
    step_fn = make_update_step(graphdef, actor_loss_fn(cfg), cfg, mesh, "actor")
    step = jax.jit(step_fn, donate_argnums=0)
    with jax.set_mesh(mesh):
        compiled = step.lower(state, arrays).compile()
        analysis = compiled.memory_analysis()
        before = _current_rss_bytes()
        jax.block_until_ready(compiled(state, arrays))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "peak_rss_bytes": peak,
        "step_rss_increase_bytes": max(peak - before, 0),
        "xla_temp_bytes": analysis.temp_size_in_bytes,
        "xla_argument_bytes": analysis.argument_size_in_bytes,
        "xla_output_bytes": analysis.output_size_in_bytes,
    }


def launch(quick: bool, chunk_size: int | None = None) -> Callable[[], dict]:
    """Starts both variants in child processes at once; the returned function waits for them and returns the result.
    ``chunk_size`` defaults to the engine's ``log_prob_chunk_size`` (a quarter of the row in quick mode, whose rows
    are shorter than that default)."""
    size = SIZES["quick" if quick else "full"]
    length = size["prompt"] + size["response"]
    chunk = chunk_size or (length // 4 if quick else ActorConfig().log_prob_chunk_size)
    specs = {"chunked": dict(size, chunk=chunk), "full_logits": dict(size, chunk=length)}
    children = {
        name: subprocess.Popen(
            [sys.executable, "-m", "bench.memory", "--child", json.dumps(spec)], cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for name, spec in specs.items()
    }

    def finish() -> dict:
        variants = {}
        for name, process in children.items():
            stdout, stderr = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(
                    f"memory child {name!r} failed (exit {process.returncode}): {stderr.strip()[-2000:]}"
                )
            variants[name] = json.loads(stdout.strip().splitlines()[-1]) | {"log_prob_chunk_size": specs[name]["chunk"]}
        return {
            "model": {key: size[key] for key in ("vocab", "hidden", "layers", "heads", "kv_heads")},
            "batch": {"rows": size["rows"], "length": length},
            "full_logits_array_bytes": size["rows"] * length * size["vocab"] * 4,
            "variants": variants,
            "peak_rss_ratio": variants["chunked"]["peak_rss_bytes"] / variants["full_logits"]["peak_rss_bytes"],
            "xla_temp_ratio": variants["chunked"]["xla_temp_bytes"] / variants["full_logits"]["xla_temp_bytes"],
        }

    return finish


def measure(quick: bool, chunk_size: int | None = None) -> dict:
    """Both variants (see :func:`launch`), waited for."""
    return launch(quick, chunk_size)()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small vocabulary and rows (CI smoke run)")
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    print(section("memory", measure(args.quick)))


if __name__ == "__main__":
    main()
