"""GRPO on the quickstart task from an SFT start against GRPO from scratch (``python -m bench.numbers.sft_to_rl``).

Runs, in one process, on all devices:

1. ``python -m jppo.sft --config configs/quickstart_sft.yaml`` (its held-out NLL and greedy score; its wall time,
   compilation and validation included, and the seconds per step after the first);
2. the GRPO quickstart from the SFT run's export (``model.path``), validated before training and every
   ``--val-every`` steps (greedy: ``rollout.val_temperature`` 0);
3. the same GRPO run from the random model.

Writes ``OUT/sft_to_rl.json``: each run's held-out greedy score (``val/reward/mean``; the SFT run's last one is
the GRPO run's first, the same policy on the same prompts) and training reward (``reward/mean``) by step, the SFT
run's times, and the machine's load when it ended. ``python -m bench.numbers.docs_numbers --only sft_to_rl`` runs
it for the numbers README.md quotes. A measurement, not a test: ``--steps`` and ``--sft-steps`` cut it short.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax

from jppo.config import check_mesh, load_config
from jppo.run import build, sft
from jppo.run.loop import run as rl_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUIET = ["trainer.plots=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.save_every=0"]


def metrics(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if key in row}


def grpo(out: pathlib.Path, steps: int, val_every: int, *overrides: str) -> dict:
    cfg = load_config(ROOT / "configs" / "quickstart_grpo.yaml", [
        *QUIET, f"trainer.output_dir={out}", f"trainer.total_steps={steps}", f"trainer.val_every={val_every}",
        "trainer.val_before_train=true", "trainer.resume=never", *overrides])
    started = time.perf_counter()
    rl_run(cfg, check_mesh(cfg, jax.device_count()), build.load_inputs(cfg))
    rows = metrics(out)
    return {"seconds": time.perf_counter() - started, "val_score": by_step(rows, "val/reward/mean"),
            "reward": by_step(rows, "reward/mean")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.numbers.sft_to_rl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench_sft_to_rl")
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps of each run")
    parser.add_argument("--val-every", type=int, default=20)
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    cfg = load_config(ROOT / "configs" / "quickstart_sft.yaml", [
        *QUIET, f"trainer.output_dir={out / 'sft'}", f"trainer.total_steps={args.sft_steps}", "trainer.resume=never"])
    started = time.perf_counter()
    inputs = sft.load_inputs(cfg)
    sft.run(cfg, sft.mesh_shape(cfg, jax.device_count()), inputs)
    sft_seconds = time.perf_counter() - started
    rows = metrics(out / "sft")
    per_step = [row["timing/step"] for row in rows if "timing/step" in row][1:]  # after the compiling first step
    result = {
        "devices": jax.device_count(), "platform": jax.devices()[0].platform,
        "sft": {"steps": args.sft_steps, "seconds": sft_seconds,
                "seconds_per_step_after_the_first": sum(per_step) / max(len(per_step), 1),
                "val_sft_nll": by_step(rows, "val/sft_nll"), "val_score": by_step(rows, "val/reward/mean")},
        "grpo_from_sft": grpo(out / "grpo_from_sft", args.steps, args.val_every, f"model.path={out / 'sft' / 'hf'}"),
        "grpo_from_scratch": grpo(out / "grpo_from_scratch", args.steps, args.val_every),
    }
    result["load_average"] = os.getloadavg()[0]
    (out / "sft_to_rl.json").write_text(json.dumps(result, indent=1) + "\n")
    for name in ("grpo_from_sft", "grpo_from_scratch"):
        print(name, "held-out greedy score by step:", {k: round(v, 3) for k, v in result[name]["val_score"].items()})
    print("sft:", {k: v for k, v in result["sft"].items() if not k.startswith("val_")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
