"""What ``trainer.deterministic: bitwise`` costs: seconds per training step against the default, side by side.

    python -m bench.bitwise [--steps N] [--shapes quickstart gsm8k]

Each shape runs ``N`` training steps twice in this process, default then bitwise, on one device, and reports the
median seconds of each phase over the steps after the first (which compiles), as the trainer measures them
(``timing/<phase>``), and the ratio bitwise / default. Shapes: ``quickstart`` (``configs/quickstart.yaml``: PPO with
a critic, 128 prompts, 2 layers d64) and ``gsm8k`` (``configs/quickstart_grpo.yaml`` at a GSM8K-like model and
length: 4 layers d256, 8 prompts x n = 8 rows, up to 128 new tokens).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

import jax

from jppo.config import check_mesh, load_config
from jppo.run import build, loop
from jppo.runlog import METRICS_FILE, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUIET = ["trainer.val_every=0", "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.plots=false",
         "trainer.progress_bar=false", "mesh.data=1"]
SHAPES = {
    "quickstart": (ROOT / "configs" / "quickstart.yaml", []),
    "gsm8k": (ROOT / "configs" / "quickstart_grpo.yaml", [
        "model.hidden_size=256", "model.intermediate_size=1024", "model.num_layers=4", "model.num_heads=4",
        "model.num_kv_heads=4", "data.train_batch_size=8", "rollout.n=8", "rollout.max_response_length=128",
        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8", "actor.ppo_epochs=1"]),
}
PHASES = ("rollout", "old_log_prob", "values", "advantages", "update_critic", "update_actor", "step")


def timed(config: pathlib.Path, overrides: list[str], steps: int, bitwise: bool) -> dict[str, float]:
    """Median ``timing/<phase>`` seconds over steps 2..N of one run."""
    with tempfile.TemporaryDirectory() as out:
        mode = "bitwise" if bitwise else "off"
        cfg = load_config(config, [*QUIET, *overrides, f"trainer.total_steps={steps}", f"trainer.output_dir={out}",
                                   f"trainer.deterministic={mode}"])
        loop.run(cfg, check_mesh(cfg, 1), build.load_inputs(cfg), devices=jax.devices()[:1])
        rows = read_metrics(pathlib.Path(out) / METRICS_FILE)[1:]
    return {phase: statistics.median(row[f"timing/{phase}"] for row in rows)
            for phase in PHASES if f"timing/{phase}" in rows[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args(argv)
    for name in args.shapes:
        config, overrides = SHAPES[name]
        default, bitwise = (timed(config, overrides, args.steps, mode) for mode in (False, True))
        print(f"\n{name}: seconds per phase (median of steps 2..{args.steps}), one CPU device")
        print(f"{'phase':<16}{'default':>10}{'bitwise':>10}{'ratio':>8}")
        for phase in default:
            ratio = bitwise[phase] / default[phase] if default[phase] else float("nan")
            print(f"{phase:<16}{default[phase]:>10.3f}{bitwise[phase]:>10.3f}{ratio:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
