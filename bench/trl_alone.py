"""TRL's GRPO step by itself: the TRL side of :mod:`bench.peers` without the harness around it.

    python -m bench.trl_alone SPEC    (started by ``python -m bench.peers --alone``; SPEC a JSON file)

The same ``GRPOConfig``, dataset, reward and exported model as the TRL side of ``bench.peers``
(:func:`bench.trl_side.trl_setup`), trained by TRL's own ``GRPOTrainer`` class: no method of it wrapped for the
phases, and a process that imports neither ``bench.peers`` nor jppo's trainer loop, with the OpenMP environment
``bench.peers`` gives its other children. Seconds per step come from the same step clock (the ends of the last
optimizer steps of successive generations), and ``train_s`` is the wall time of ``trainer.train()`` as a second
clock. ``bench.peers`` runs it after TRL's in-harness run of every round, so its table shows TRL's own step next
to the harnessed one (``trl_alone_s_per_step``).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from bench.environment import match_torch_threads
from bench.trl_side import per_step_seconds, train, trl_setup
from jppo.config import load_config


def run_alone(spec: dict) -> dict:
    """``spec["steps"]`` training steps of ``GRPOTrainer`` at the config ``spec["config"]`` with
    ``spec["overrides"]``; per-step seconds, the whole ``train()`` wall time, torch's threads and OpenMP's policy."""
    from trl import GRPOTrainer

    match_torch_threads()
    cfg = load_config(spec["config"], spec["overrides"])
    setup = trl_setup(cfg, spec["steps"], pathlib.Path(spec["out"]))
    start = time.perf_counter()
    train(setup, GRPOTrainer)
    return {
        "steps": [{"step": seconds} for seconds in per_step_seconds(setup.marks)],
        "train_s": time.perf_counter() - start, "mean_response_length": setup.mean_response_length(),
        "torch_threads": setup.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("bench.trl_alone: error: expected one argument, the JSON spec bench.peers writes", file=sys.stderr)
        return 2
    path = pathlib.Path(argv[0])
    result = run_alone(json.loads(path.read_text()))
    path.with_suffix(".result").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
