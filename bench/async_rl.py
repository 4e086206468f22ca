"""Off-policy steps: seconds per GRPO training step with ``trainer.off_policy_steps`` 0 and 1, side by side.

    python -m bench.async_rl [--quick] [--steps N] [--engines jppo,jppo-own-device,vllm]

The shape is :mod:`bench.peers`' GSM8K-like one (4 layers d256, 8 prompts x 8, prompts of 64 tokens, responses up
to 128, one optimizer step per training step), its policy exported and loaded by ``model.path`` as there. For each
engine (``rollout.engine``: jppo's sampler, and vLLM when it imports) the two runs alternate (k = 0, then k = 1),
each in a fresh process on one device, where k = 1 generates the next batch on a thread beside the update.
``jppo-own-device`` is jppo's sampler on a device of its own: two simulated CPU devices, ``rollout.devices=1``
(the update on the first, the sampler on the second, the weights moved to it before every rollout).
``vllm-server`` is vLLM in a server process of its own (``rollout.vllm.num_servers=1``), the weights streamed to it
over gloo before every rollout (``weight_push_s``, ``weight_push_bytes``).
Printed as JSON, per engine and k: the median over steps ``MEDIAN_FROM``.. (but the last) of ``timing/step``, of the
rollout phase (``timing/rollout`` + ``reward`` + ``weight_push`` + ``weight_move``: what the generation side does), of
the train phase (every other ``timing/*`` phase: old log-probs, advantages, the update), of the ``async/*`` waits and,
with a device of its own, of the weight move (``weight_move_s``, its share of the step ``weight_move_share`` and its
bytes); and the ratios

- ``async_k1_vs_k0``: the k = 0 step's seconds over the k = 1 step's (> 1: off-policy steps are faster here);
- ``async_bound_speedup``: (rollout + train) / max(rollout, train) from the k = 0 phases: the step time one
  overlap could reach when the two sides do not share hardware (a generator beside the trainer on an
  accelerator), the bound the k = 1 step approaches.

On a shared 2-core CPU both sides run on the same two cores: the overlap can only use cores one side leaves idle
(the sampler's small decode steps do not fill both), so ``async_k1_vs_k0`` here is well below the bound, and
says that the overlap works and costs nothing, not what an accelerator gains. ``--quick``: tiny sizes, 4 steps,
in this process (a smoke run whose numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
from typing import Optional, Sequence

import jax

from bench import child_environment, peers
from jppo.config import load_config
from jppo.rollout import vllm_engine

FULL_STEPS, QUICK_STEPS = 7, 4
# medians over steps MEDIAN_FROM .. the one before the last: steps 1-2 compile (and k = 1 generates its first batch
# in turn), and the last step of a k = 1 run generates nothing (no batch past the last step)
MEDIAN_FROM = 3
ROLLOUT_PHASES = ("timing/rollout", "timing/reward", "timing/weight_push", "timing/weight_move")
# vLLM's CPU build as bench.vllm_engine runs it: eager, a small KV cache
VLLM = ("rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_memory_bytes=268435456")
# what each measured engine adds to the config, and the devices its runs get
LAYOUTS = {"jppo": ((), 1), "jppo-own-device": (("rollout.devices=1",), 2), "vllm": (VLLM, 1),
           "vllm-server": ((*VLLM, "rollout.vllm.num_servers=1"), 1)}


def phases(record: dict) -> tuple[float, float]:
    """``(rollout, train)`` seconds of one step's metrics: the generation side's phases, and every other phase."""
    timed = {k: v for k, v in record.items() if k.startswith("timing/") and k != "timing/step"}
    rollout = sum(timed.get(name, 0.0) for name in ROLLOUT_PHASES)
    return rollout, sum(timed.values()) - rollout


def summarize(records: list[dict], first: int) -> dict:
    """Medians over steps ``first`` .. the one before the last of the step, its two phases and the waits (the
    waits only where logged)."""
    last = max(r["step"] for r in records)
    kept = [r for r in records if first <= r["step"] < last] or records[-1:]
    median = lambda values: statistics.median(values)  # noqa: E731
    out = {"step_s": median([r["timing/step"] for r in kept]),
           "rollout_s": median([phases(r)[0] for r in kept]), "train_s": median([phases(r)[1] for r in kept]),
           "steps": [round(r["timing/step"], 3) for r in records]}
    for name in ("async/train_wait_s", "async/rollout_wait_s"):
        if name in kept[0]:
            out[name.split("/")[1]] = median([r[name] for r in kept])
    if "rollout/weight_push_bytes" in kept[0]:  # vLLM on a server: the weights streamed to it every step
        out["weight_push_s"] = median([r.get("timing/weight_push", 0.0) for r in kept])
        out["weight_push_bytes"] = kept[0]["rollout/weight_push_bytes"]
    if "timing/weight_move" in kept[0]:
        out["weight_move_s"] = median([r["timing/weight_move"] for r in kept])
        out["weight_move_share"] = median([r["timing/weight_move"] / r["timing/step"] for r in kept])
        out["weight_move_bytes"] = kept[0]["perf/weight_move_bytes"]
    return out


def ratios(k0: dict, k1: dict) -> dict:
    """``async_k1_vs_k0`` and ``async_bound_speedup`` (see the module docstring)."""
    bound = (k0["rollout_s"] + k0["train_s"]) / max(k0["rollout_s"], k0["train_s"])
    return {"async_k1_vs_k0": k0["step_s"] / k1["step_s"], "async_bound_speedup": bound}


def measure_engine(overrides: list[str], out: pathlib.Path, fresh: bool, devices: int = 1) -> dict:
    """k = 0 then k = 1 on the same config (``fresh``: each in its own process, :func:`bench.peers.run_side`, with
    ``devices`` simulated CPU devices)."""
    result = {}
    out.mkdir(parents=True, exist_ok=True)
    env = child_environment("user") | {"JAX_NUM_CPU_DEVICES": str(devices)}
    for k in (0, 1):
        run = [*overrides, f"trainer.off_policy_steps={k}", f"trainer.output_dir={out / f'k{k}'}"]
        if fresh:
            records = peers.run_side({"side": "jppo", "overrides": run}, out / f"k{k}.json", env)["records"]
        else:
            records = peers.run_jppo(load_config(peers.QUICKSTART_GRPO, run), devices)["records"]
        result[f"k{k}"] = summarize(records, MEDIAN_FROM)
    return result | ratios(result["k0"], result["k1"])


def measure(quick: bool, steps: Optional[int] = None,
            engines: Sequence[str] = ("jppo", "jppo-own-device", "vllm")) -> dict:
    """Every engine's k = 0 / k = 1 comparison; an engine that cannot run here gets its reason instead."""
    shape = (peers.QUICK_SHAPES if quick else peers.SHAPES)["gsm8k_shape"]
    steps = steps or (QUICK_STEPS if quick else FULL_STEPS)
    result: dict = {"mode": "quick" if quick else "full", "steps": steps, "median_from": MEDIAN_FROM, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="jppo-async-") as tmp:
        _, overrides = peers.shape_config(shape, steps, pathlib.Path(tmp))
        for engine in engines:
            if engine.startswith("vllm") and not vllm_engine.installed():
                result["engines"][engine] = {"missing": "vLLM is not installed"}
                continue
            extra, devices = LAYOUTS[engine]
            result["engines"][engine] = measure_engine(overrides + list(extra), pathlib.Path(tmp) / engine,
                                                       fresh=not quick, devices=devices)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.async_rl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, 4 steps, jppo's engine, in this process")
    parser.add_argument("--steps", type=int, help=f"training steps per run (default {FULL_STEPS}, quick {QUICK_STEPS})")
    parser.add_argument("--engines", help="comma-separated, of " + ", ".join(LAYOUTS) + " (default: all; quick: "
                        "jppo)")
    args = parser.parse_args(argv)
    engines = args.engines.split(",") if args.engines else (["jppo"] if args.quick else list(LAYOUTS))
    unknown = [name for name in engines if name not in LAYOUTS]
    if unknown:
        parser.error(f"--engines: unknown {', '.join(unknown)} (known: {', '.join(LAYOUTS)})")
    if args.quick:  # in this process: as many CPU devices as the most any engine asks for, before JAX starts
        jax.config.update("jax_num_cpu_devices", max(LAYOUTS[name][1] for name in engines))
    print(json.dumps(measure(args.quick, args.steps, engines), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
