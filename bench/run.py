"""Runs every benchmark and writes ``results.json`` and ``results.md`` into the output directory.

    python -m bench.run [--quick] [--out DIR] [--repeats N] [--only NAME,...]
                        [--accelerator auto|full|stand-in|off] [--peak-tflops X] [--bandwidth-gbs Y]
                        [--e2e-set key.sub=value ...]

Benchmarks (each a ratio of candidates measured side by side in this one run; see each module's docstring):
``accumulation`` (K = 1..8 micro-batches, global vs legacy normalization), ``update_vs_torch`` (jppo vs PyTorch
eager, tiny and small), ``sampler`` (KV cache vs recomputation vs transformers), ``rollout_shapes`` (the sampler
vs transformers at a GSM8K-like shape), ``batching`` (continuous batching on a long-tailed workload, one prompt
block per prompt vs per sample), ``end_to_end`` (the quickstart config), ``peers`` (seconds per GRPO step vs
TRL's GRPOTrainer and Tunix's GRPOLearner, each when installed), and ``accelerator`` (MFU, decode roofline, device
memory), which runs by default only when JAX's backend is a GPU or TPU.

``--quick`` is CI's smoke mode: tiny sizes, two repeats, the quickstart for a few steps, and XLA's backend
optimisation level 0 (compiles in about half the time; the programs are the same, only slower): its numbers mean
nothing. The persistent compilation cache is switched off so compile times are real. Headline ratios are
top-level keys of ``results.json`` (their meanings under ``ratio_meanings``); everything measured is under
``benchmarks``. ``--peak-tflops`` / ``--bandwidth-gbs`` override the accelerator's peaks (needed where
:data:`bench.accelerator.DEVICE_PEAKS` does not know the device).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import pathlib
import sys
import time
from typing import Callable

import jax

from bench import end_to_end
from bench.environment import describe, match_torch_threads
from bench.report import write
from jppo.config import ConfigError

# Smoke mode compiles with LLVM optimisation off: about half the compile time, the same programs.
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0"
# Every benchmark, in the order they run, with the top-level keys of results.json its result gives: key -> (where
# in the result, dotted; what it means, listed under ratio_meanings, or None for a key that is not a number).
HEADLINES: dict[str, dict[str, tuple[str, str | None]]] = {
    "accumulation": {
        "accumulation_overhead_k8": ("accumulation_overhead_k8", "actor update time per token with K=8 "
                                     "micro-batches / with K=1 (goal <= 1.10)"),
        "accumulation_compile_ratio_k8": ("compile_ratio_k8", "compile time of the update with K=8 / with K=1 "
                                          "(goal: about 1)"),
        "normalization_overhead": ("normalization_overhead", "global-normalized update time / legacy "
                                   "per-micro-batch one, K=8 (goal <= 1.02)"),
    },
    "update_vs_torch": {
        "update_vs_torch_tiny": ("tiny.ratio", "jppo actor update tokens/s / PyTorch eager tokens/s, tiny size "
                                 "(full mode: 2 layers d128); > 1: jppo faster"),
        "update_vs_torch_small": ("small.ratio", "jppo actor update tokens/s / PyTorch eager tokens/s, small size "
                                  "(full mode: 4 layers d512, T=256); > 1: jppo faster"),
    },
    "sampler": {
        "sampler_vs_recompute": ("sampler_vs_recompute", "KV-cache sampler tokens/s / full-recomputation decoding "
                                 "tokens/s (> 1: sampler faster)"),
        "sampler_vs_transformers": ("sampler_vs_transformers", "KV-cache sampler tokens/s / transformers generate "
                                    "tokens/s (> 1: jppo faster)"),
    },
    "rollout_shapes": {
        "rollout_vs_transformers_gsm8k_shape": ("rollout_vs_transformers", "KV-cache sampler tokens/s / "
                                                "transformers generate (KV cache) tokens/s at a GSM8K-like shape: 4 "
                                                "layers d256, 8 prompts x n=8 of 64 tokens, 128 new tokens, EOS "
                                                "suppressed, sampling (> 1: jppo faster)"),
    },
    "batching": {
        "rollout_useful_slot_fraction": ("continuous_batching.rollout_useful_slot_fraction", "decoding row-steps "
                                         "that produced a token / row-steps decoded, continuous batching on the "
                                         "long-tailed workload (goal >= 0.8)"),
        "rollout_all_rows_useful_slot_fraction": ("continuous_batching.all_rows.useful_slot_fraction", "the same "
                                                  "fraction decoding every row at once until the longest ends"),
        "rollout_continuous_vs_all_rows": ("continuous_batching.rollout_continuous_vs_all_rows", "tokens/s with "
                                           "continuous batching / every row at once, long-tailed workload"),
        "rollout_shared_prefix_memory_ratio": ("shared_prefix.rollout_shared_prefix_memory_ratio", "sampler cache "
                                               "bytes with one prompt block per prompt / one per sample, 2048-token "
                                               "prompts, 256 new, n = 8 (goal <= 0.5)"),
        "rollout_shared_prefix_speedup": ("shared_prefix.speedup", "seconds per rollout, prompt block per sample / "
                                          "shared, same shape"),
    },
    "end_to_end": {
        "e2e_seconds_per_step": ("seconds_per_step", "median seconds per quickstart training step after the first "
                                 "(not a ratio)"),
        "time_to_target_s": ("time_to_target.wall_s", "wall seconds until the quickstart's reward/mean first "
                             "reaches 0.9 (null: not reached)"),
    },
    "peers": {
        "e2e_vs_trl_grpo": ("e2e_vs_trl_grpo_gsm8k_shape", "= e2e_vs_trl_grpo_gsm8k_shape"),
        "e2e_vs_trl_grpo_quickstart": ("e2e_vs_trl_grpo_quickstart", "TRL GRPOTrainer s/step / jppo s/step, "
                                       "quickstart GRPO shape (2 layers d64, 16 prompts x 8, responses <= 5); > 1: "
                                       "jppo faster; null without TRL (reason: e2e_vs_trl_grpo_reason)"),
        "e2e_vs_trl_grpo_gsm8k_shape": ("e2e_vs_trl_grpo_gsm8k_shape", "TRL GRPOTrainer s/step / jppo s/step, "
                                        "GSM8K-like shape (4 layers d256, 8 prompts x 8, prompts 64 tokens, "
                                        "responses <= 128); > 1: jppo faster; null without TRL"),
        "e2e_vs_trl_grpo_reason": ("trl_missing", None),
        "e2e_vs_tunix_grpo_quickstart": ("e2e_vs_tunix_grpo_quickstart", "Tunix GRPOLearner s/step / jppo s/step, "
                                         "quickstart GRPO shape, both JAX on the same XLA; > 1: jppo faster; null "
                                         "without Tunix (reason: e2e_vs_tunix_grpo_reason)"),
        "e2e_vs_tunix_grpo_gsm8k_shape": ("e2e_vs_tunix_grpo_gsm8k_shape", "Tunix GRPOLearner s/step / jppo s/step, "
                                          "GSM8K-like shape, both JAX on the same XLA; > 1: jppo faster; null "
                                          "without Tunix"),
        "e2e_vs_tunix_grpo_reason": ("tunix_missing", None),
    },
    "accelerator": {
        "accelerator_mfu": ("update.mfu", "model FLOPs utilisation of the ~0.5B bf16 update step (accelerator "
                            "mode)"),
        "accelerator_decode_vs_roofline": ("decode.fraction_of_roofline", "decode tokens/s / memory-bandwidth "
                                           "roofline (accelerator mode)"),
    },
}
ORDER = tuple(HEADLINES)
RATIO_MEANINGS = {key: meaning for keys in HEADLINES.values() for key, (_, meaning) in keys.items() if meaning}


def _headlines(name: str, result: dict) -> dict:
    """The top-level keys a benchmark's result contributes to ``results.json`` (None where its result has none)."""
    return {key: functools.reduce(lambda value, part: (value or {}).get(part), where.split("."), result)
            for key, (where, _) in HEADLINES[name].items()}


# The benchmarks whose peers are PyTorch / transformers models import torch: each benchmark is imported only when
# it runs, so that `--only accelerator` runs on an image without torch (a GPU image with its own jax).
TORCH_BENCHMARKS = ("update_vs_torch", "sampler", "rollout_shapes", "peers")


def benchmarks(args: argparse.Namespace, out: pathlib.Path, names: list[str]) -> dict[str, Callable[[], dict]]:
    """A function per selected benchmark, in the order to call them. Most take ``measure(quick, repeats)``."""
    repeats = args.repeats or (2 if args.quick else 5)
    stand_in = args.accelerator == "stand-in"
    peaks = (
        args.peak_tflops * 1e12 if args.peak_tflops else None, args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else None
    )
    other = {
        "peers": lambda peers: peers.measure(args.quick),
        "end_to_end": lambda e2e: e2e.measure(args.quick, out / "quickstart_run", extra_overrides=args.e2e_set),
        "accelerator": lambda acc: acc.measure(acc.STAND_IN_SIZE if stand_in else acc.FULL, *peaks),
    }

    def runner(name: str) -> Callable[[], dict]:
        measure = other.get(name, lambda module: module.measure(args.quick, repeats))
        return lambda: measure(importlib.import_module(f"bench.{name}"))

    return {name: runner(name) for name in names}


def selected(args: argparse.Namespace) -> list[str]:
    names = ORDER if args.only is None else [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in ORDER]
    if unknown:
        raise SystemExit(f"bench.run: error: unknown benchmark(s) {', '.join(unknown)}; valid: {', '.join(ORDER)}")
    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    wanted = args.accelerator in ("full", "stand-in") or (args.accelerator == "auto" and on_accelerator)
    return [name for name in names if name != "accelerator" or wanted]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, 2 repeats: CI's smoke mode (< 3 min on 2 cores)"
    )
    parser.add_argument("--out", default="runs/bench", help="output directory (default: runs/bench)")
    parser.add_argument("--repeats", type=int, help="timed repeats after the warm-up (default: 5, quick: 2)")
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(ORDER)}")
    parser.add_argument(
        "--accelerator", choices=("auto", "full", "stand-in", "off"), default="auto",
        help="accelerator benchmarks: auto = the ~0.5B model when the backend is gpu/tpu; stand-in = a tiny model "
        "on any backend (exercises the code on CPU)",
    )
    parser.add_argument(
        "--e2e-set", action="append", default=[], metavar="KEY=VALUE",
        help="config override for the end-to-end run (repeatable), e.g. trainer.total_steps=300",
    )
    parser.add_argument("--peak-tflops", type=float, help="accelerator dense bf16 peak (default: from the table)")
    parser.add_argument("--bandwidth-gbs", type=float, help="accelerator memory bandwidth, GB/s (default: the table)")
    return parser.parse_args(argv)


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the numeric arguments, in one line (``None``: nothing)."""
    if args.repeats is not None and args.repeats < 1:
        return f"--repeats={args.repeats} must be >= 1"
    for flag, value in (("--peak-tflops", args.peak_tflops), ("--bandwidth-gbs", args.bandwidth_gbs)):
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"{flag}={value} must be a finite number > 0"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = argument_problem(args)
    if problem is not None:
        print(f"bench.run: error: {problem}", file=sys.stderr)
        return 2
    if args.quick:
        # before the backend starts (XLA reads its flags once); child processes inherit it
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_XLA_FLAGS}".strip()
    names = selected(args)
    out = pathlib.Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if "end_to_end" in names:  # its config, checked before minutes of other benchmarks
            end_to_end.check_overrides(args.quick, args.e2e_set)
    except OSError as error:
        print(f"bench.run: error: --out {str(out)!r}: {error.strerror or error}", file=sys.stderr)
        return 2
    except ConfigError as error:
        print(f"bench.run: error: --e2e-set: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    jax.config.update("jax_enable_compilation_cache", False)  # compile times are part of what is measured
    started = time.perf_counter()
    environment = describe() | {
        "torch_threads": match_torch_threads() if set(names) & set(TORCH_BENCHMARKS) else None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    results: dict = {
        "mode": "quick" if args.quick else "full", "environment": environment, "ratio_meanings": RATIO_MEANINGS
    }
    details: dict = {}
    wall: dict[str, float] = {}
    for name, run in benchmarks(args, out, names).items():
        print(f"bench.run: {name} ...", file=sys.stderr, flush=True)
        begin = time.perf_counter()
        details[name] = run()
        wall[name] = time.perf_counter() - begin
        results |= _headlines(name, details[name])
        print(f"bench.run: {name} done in {wall[name]:.1f} s", file=sys.stderr, flush=True)
    results["benchmarks"] = details
    results["benchmark_wall_s"] = wall
    results["wall_s"] = time.perf_counter() - started
    results["environment"]["load_average_1m_end"] = os.getloadavg()[0]
    write(results, out)
    print(f"bench.run: wrote {out / 'results.json'} and {out / 'results.md'} in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
