"""The learning corridors ``tests/test_learning.py`` holds each quickstart to: ``tests/corridors.json``.

    python -m bench.numbers.corridors [--seeds 0,1,2,3] [--only quickstart,grpo]

Trains each run of :data:`RUNS` for its first ``steps`` steps (the shipped config, seed by seed, in this process on
8 simulated CPU devices at XLA's lowest optimization level: what the test suite runs; no validation) and records,
per seed, the training reward over the first 3 and the last 5 steps (an SFT run: its NLL), and the largest gradient
norm and sampler-trainer KL (``rollout_corr/kl``) of the run. The corridor of each number is the seeds' range
widened by a margin the spread justifies: ``max(spread, floor)`` beyond the worst seed for the reward and the NLL
(the floors in :data:`FLOORS`, 0.05 for the NLL), twice the largest seed's for the bands (at least 1e-3 for the
KL). The test trains seed 0 and fails when a number leaves its corridor, so a change that quietly stops a
quickstart learning fails CI.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORRIDORS = ROOT / "tests" / "corridors.json"
# name: (config, steps, overrides): few steps, where the curve has left its start whatever the seed
RUNS = {
    "quickstart": ("configs/quickstart.yaml", 40, ()),
    "grpo": ("configs/quickstart_grpo.yaml", 40, ()),
    "moe": ("configs/quickstart_moe.yaml", 40, ()),
    "sft": ("configs/quickstart_sft.yaml", 30, ()),
}
# the least a reward corridor is widened below the lowest seed (rewards in [0, 1])
FLOORS = {"reward_last5": 0.05}
BANDS = ("grad_norm_max", "kl_max")
KL_FLOOR = 1e-3


def overrides(name: str, seed: int, out: pathlib.Path) -> list[str]:
    config, steps, extra = RUNS[name]
    # no validation: the training curve is the signal, and the suite's minutes are few
    return [f"trainer.seed={seed}", f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.val_every=0",
            "trainer.val_before_train=false", "trainer.save_every=0", "trainer.plots=false", "trainer.logger=[jsonl]",
            "trainer.progress_bar=false", "trainer.export_hf=false", *extra]


def measure(name: str, seed: int, out: pathlib.Path) -> dict[str, float]:
    """Trains run ``name`` with ``seed`` into ``out`` on every device of this process; its corridor numbers."""
    import jax  # noqa: PLC0415

    from jppo.config import check_mesh, load_config  # noqa: PLC0415

    config, steps, _ = RUNS[name]
    items = overrides(name, seed, out)
    if name == "sft":
        from jppo.run import sft  # noqa: PLC0415

        cfg = load_config(ROOT / config, items, sft=True)
        sft.run(cfg, sft.mesh_shape(cfg, jax.device_count()), sft.load_inputs(cfg))
    else:
        from jppo.run import build  # noqa: PLC0415
        from jppo.run.loop import run  # noqa: PLC0415

        cfg = load_config(ROOT / config, items)
        run(cfg, check_mesh(cfg, jax.device_count()), build.load_inputs(cfg))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == steps
    if name == "sft":
        steps = [r for r in rows if "sft/nll" in r]
        return {"nll_first3": statistics.mean(r["sft/nll"] for r in steps[:3]),
                "nll_last5": statistics.mean(r["sft/nll"] for r in steps[-5:]),
                "grad_norm_max": max(r["sft/grad_norm"] for r in steps)}
    return {"reward_first3": statistics.mean(r["reward/mean"] for r in rows[:3]),
            "reward_last5": statistics.mean(r["reward/mean"] for r in rows[-5:]),
            "grad_norm_max": max(r["actor/grad_norm"] for r in rows),
            "kl_max": max(r["rollout_corr/kl"] for r in rows)}


def corridor(values: list[float], key: str) -> list[float]:
    """``[low, high]`` for ``key`` from its values over the seeds (module docstring)."""
    low, high = min(values), max(values)
    if key in BANDS:  # the KL's floor: float32 log-probs that differ by rounding give KL ~1e-12, a mismatch ~1e-2
        return [0.0, max(2 * high, KL_FLOOR if key == "kl_max" else 0.0)]
    if key == "nll_last5":  # lower is better: bounded above
        return [0.0, high + max(high - low, 0.05)]
    if key in FLOORS:
        return [low - max(high - low, FLOORS[key]), float("inf")]
    return [-float("inf"), float("inf")]  # recorded, not held (the start of the curve)


def main(argv=None) -> None:
    import jax  # noqa: PLC0415

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_disable_most_optimizations", True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--only", default=",".join(RUNS))
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    table = json.loads(CORRIDORS.read_text()) if CORRIDORS.is_file() else {}
    for name in args.only.split(","):
        measured = {}
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                measured[seed] = measure(name, seed, pathlib.Path(tmp))
            print(name, seed, {k: round(v, 4) for k, v in measured[seed].items()}, flush=True)
        keys = measured[seeds[0]]
        table[name] = {
            "config": RUNS[name][0], "steps": RUNS[name][1], "seeds": seeds,
            "measured": {str(seed): {k: round(v, 4) for k, v in values.items()} for seed, values in measured.items()},
            "corridor": {k: [round(b, 4) if abs(b) != float("inf") else None for b in
                             corridor([measured[s][k] for s in seeds], k)] for k in keys},
        }
    CORRIDORS.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {CORRIDORS}")


if __name__ == "__main__":
    main()
