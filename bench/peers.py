"""End to end against peer trainers: seconds per GRPO training step of jppo vs TRL's ``GRPOTrainer`` and vs
Google's Tunix ``GRPOLearner`` (JAX, on the same XLA).

    python -m bench.peers [--quick] [--shapes quickstart,gsm8k_shape] [--steps N] [--rounds R]
                          [--omp user|passive] [--alone]

The trainers run on this CPU in float32, on the same model, task, prompts, reward, batch, group size and lengths,
alternated for ``--rounds`` (jppo, TRL, Tunix), never concurrently, each run in a fresh process of its own
(:func:`run_side`: a trainer run after another in one process ran up to 2x slower); the parent process only exports
the weights, checks the logits and reads the children's results. Every child runs with ``OMP_WAIT_POLICY`` as the
user's shell has it (``--omp user``, the default; why: :mod:`bench`) or ``PASSIVE`` (``--omp passive``), recorded per
child.
``--alone`` adds :mod:`bench.trl_alone` after TRL's run in every round: TRL's own ``GRPOTrainer`` with nothing
wrapped, in a process that imports nothing of this harness (``trl_alone_s_per_step``).

- **weights**: jppo's initial policy (built from the config as the trainer builds it) is written as a Hugging
  Face directory by :func:`jppo.run.export.export_policy` (float32, with the tokenizer); jppo trains from it
  (``model.path``) and TRL loads it as ``transformers.Qwen2ForCausalLM``. Their logits on the task's prompts are
  compared before anything is timed (``logits_max_abs_diff``; the run stops above ``LOGITS_ATOL``).
- **task and reward**: TRL's dataset holds the task's training prompts and answers and its reward function calls
  jppo's own with the decoded completions; the prompt ids are the same on both sides (the export's tokenizer
  files, BOS first).
- **Tunix**: :mod:`bench.tunix_side` (its own Qwen2 loader on the same export, its vanilla sampler, the same
  reward, batch and optimizer; how each setting is matched, and the one ordering difference, is said there). Its
  logits are checked against jppo's in its own process (``tunix_logits_max_abs_diff``, the same bound).
- **the step**: ``rollout.n`` samples per prompt at temperature 1 (no top-k / top-p); no KL, no entropy bonus,
  clip 0.2, AdamW at a constant learning rate, the actor's gradient clipping, token-mean loss (TRL's ``dapo``),
  advantages normalized by the group's std, no activation recomputation on either side. One jppo training step is
  one TRL generation and the same optimizer steps over the same micro-batches
  (:func:`bench.trl_side.trl_arguments`); neither side runs the old-log-prob pass where the step is on-policy.

Shapes (:data:`SHAPES`): ``quickstart`` (``configs/quickstart_grpo.yaml``: 2 epochs of 2 mini-batches, so both
sides run the old-log-prob pass) and ``gsm8k_shape`` (4 layers d256, 8 prompts x 8 of 64 tokens, responses up to
128, one optimizer step per training step). Its task is ``reverse_digits`` over 62 digits with a vocabulary of
1024 characters (the task's 11 plus unused ones), so that an untrained policy rarely samples EOS and responses run
long, as GSM8K's do.

Seconds per step: jppo's ``timing/step``; TRL's the wall time between the ends of the last optimizer steps of two
successive generations (:class:`bench.trl_side.TrlSetup`); Tunix's between the ends of two successive global steps
(:func:`bench.tunix_side.run_tunix`). Medians over steps ``MEDIAN_FROM``.. of every round, per
phase too: jppo's ``timing/*``, TRL's from wrappers around its methods (:func:`bench.trl_side.run_trl`). TRL is a
benchmark-only tool, never a dependency of jppo: without it (or with ``JPPO_BENCH_NO_TRL=1``) its ratios are
``None`` with the reason; so are Tunix's without Tunix (or with ``JPPO_BENCH_NO_TUNIX=1``), and with neither peer
nothing runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

import jax
import numpy as np
import torch

from bench import OMP_MODES, child_environment
from bench.environment import match_torch_threads
from bench.report import section
from bench.trl_side import run_trl, trl_arguments
from bench.tunix_side import run_tunix, tunix_batches, tunix_missing, tunix_version
from jppo.config import TrainConfig, check_mesh, load_config
from jppo.data import CharTokenizer
from jppo.run import build, loop
from jppo.run.export import export_policy
from jppo.runlog import METRICS_FILE, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART_GRPO = ROOT / "configs" / "quickstart_grpo.yaml"
HIDE_TRL_ENV = "JPPO_BENCH_NO_TRL"  # set (to anything but "" or "0") to measure as if TRL were not installed
LOGITS_ATOL = 1e-5
MEDIAN_FROM = 3  # first step of the medians (steps 1-2: compilation on jppo's side, warm-up on both)
# the same step on both sides: no KL, no entropy bonus, nothing run between the steps
COMMON = (
    "actor.entropy_coeff=0.0", "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
    "rollout.temperature=1.0", "rollout.top_k=0", "rollout.top_p=1.0", "actor.clip_ratio=0.2",
    "trainer.val_every=0", "trainer.save_every=0", "trainer.logger=[jsonl]", "trainer.plots=false",
    "trainer.progress_bar=false", "trainer.resume=never",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One comparison: config overrides on ``configs/quickstart_grpo.yaml`` and, where the task's own vocabulary
    is not used, the size of a character vocabulary (the task's alphabet first)."""

    overrides: tuple[str, ...]
    vocab_size: Optional[int] = None


GSM8K_MODEL = ("model.hidden_size=256", "model.intermediate_size=1024", "model.num_layers=4", "model.num_heads=4")
SHAPES = {
    "quickstart": Shape(()),
    "gsm8k_shape": Shape(
        GSM8K_MODEL + (
            "data.train_batch_size=8", "data.task_options={min_len: 62, max_len: 62}", "data.max_prompt_length=64",
            "rollout.prompt_bucket=64", "rollout.max_response_length=128", "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size=8", "actor.ppo_epochs=1",
        ),
        vocab_size=1024,
    ),
}
# smoke sizes for CI: the same code paths, numbers that mean nothing
QUICK_SHAPES = {
    "quickstart": Shape(("data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
                         "actor.ppo_micro_batch_size=4")),
    "gsm8k_shape": Shape(
        ("model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=4",
         "data.train_batch_size=2", "rollout.n=4", "data.task_options={min_len: 7, max_len: 7}",
         "data.max_prompt_length=16", "rollout.max_response_length=8", "actor.ppo_mini_batch_size=2",
         "actor.ppo_micro_batch_size=4", "actor.ppo_epochs=1"),
        vocab_size=64,
    ),
}
FULL_STEPS, QUICK_STEPS = 12, 3
FULL_ROUNDS = 3  # alternated jppo/TRL/Tunix runs per shape in full mode (quick: 1)
PEERS = ("trl", "tunix")  # the peer sides, in the order each round runs them after jppo


def trl_missing() -> Optional[str]:
    """Why TRL cannot be used here (``None``: it can)."""
    if os.environ.get(HIDE_TRL_ENV, "") not in ("", "0"):
        return f"TRL hidden by {HIDE_TRL_ENV}={os.environ[HIDE_TRL_ENV]}"
    try:
        importlib.import_module("trl")
        importlib.import_module("datasets")
    except ImportError as error:
        return f"TRL is not installed ({error}); it is a benchmark-only tool: pip install trl"
    return None


def wide_alphabet(task_alphabet: str, vocab_size: int) -> str:
    """The task's characters followed by other printable ones, ``vocab_size`` tokens with the 3 special ones."""
    codes = range(0x100, 0x100 + 4 * vocab_size)
    extra = (chr(c) for c in codes if chr(c).isprintable() and chr(c) not in task_alphabet)
    wanted = vocab_size - len(CharTokenizer.SPECIAL_TOKENS) - len(task_alphabet)
    return task_alphabet + "".join(next(extra) for _ in range(wanted))


def logits_max_abs_diff(export_dir: str | pathlib.Path, ids: np.ndarray) -> float:
    """Largest |jppo logit - transformers logit| of the exported model on ``ids`` ([B, T], no padding)."""
    import transformers

    from jppo.models import load_pretrained

    ours = np.asarray(load_pretrained(str(export_dir))(jax.numpy.asarray(ids, jax.numpy.int32)))
    peer = transformers.Qwen2ForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = peer(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    return float(np.abs(ours - theirs).max())


def shape_config(shape: Shape, steps: int, out: pathlib.Path) -> tuple[TrainConfig, list[str]]:
    """The exported initial policy of ``shape`` in ``out / "model"`` and the config jppo trains it with."""
    base = [*COMMON, *shape.overrides, f"trainer.total_steps={steps}", f"trainer.output_dir={out / 'jppo'}"]
    if shape.vocab_size is not None:
        task_cfg = load_config(QUICKSTART_GRPO, base)
        alphabet = wide_alphabet(build.task_of(task_cfg.data).alphabet, shape.vocab_size)
        (out / "tokenizer").mkdir(parents=True, exist_ok=True)
        for name, text in CharTokenizer(alphabet).hf_files().items():
            (out / "tokenizer" / name).write_text(text, encoding="utf-8")
        base.append(f"model.tokenizer={out / 'tokenizer'}")
    initial = load_config(QUICKSTART_GRPO, base)
    tokenizer = build.load_inputs(initial).tokenizer
    with jax.default_device(jax.devices("cpu")[0]):
        policy = build.build_policy(initial, tokenizer, mesh=None)
    export_policy(policy, initial, tokenizer, out / "model", dtype="float32")
    overrides = [item for item in base if not item.startswith("model.tokenizer=")] + [f"model.path={out / 'model'}"]
    return load_config(QUICKSTART_GRPO, overrides), overrides


def run_jppo(cfg: TrainConfig, devices: Optional[int] = None) -> dict:
    """One in-process training run on the first ``devices`` devices (default: all); its ``metrics.jsonl`` records
    of steps >= 1."""
    count = devices or jax.device_count()
    loop.run(cfg, check_mesh(cfg, count), build.load_inputs(cfg), devices=jax.devices()[:count])
    return {"records": [r for r in read_metrics(pathlib.Path(cfg.trainer.output_dir) / METRICS_FILE) if r["step"] >= 1]}


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _peer_step_median(run: dict, first: int) -> Optional[float]:
    return _median([s["step"] for s in run["steps"][first - 1:]])


def _peer_summary(side: str, runs: Sequence[dict], first: int, ours: dict) -> dict:
    """One peer's medians (``side``: ``trl`` or ``tunix``, runs holding ``steps`` as :func:`bench.trl_side.run_trl`
    returns them) over steps ``first``.., per phase and for the whole step, and its s/step over jppo's."""
    steps = [s for run in runs for s in run["steps"][first - 1:]]
    theirs = {k: _median([s[k] for s in steps]) for k in (steps[0] if steps else {})}
    ratio = theirs["step"] / ours["step"] if theirs.get("step") and ours.get("step") else None
    return {
        f"{side}_s_per_step": theirs.get("step"), f"{side}_over_jppo": ratio, f"{side}_phases_s": theirs,
        f"{side}_first_step_s": [run["steps"][0]["step"] for run in runs if run["steps"]],
        f"{side}_mean_response_length": _median([run["mean_response_length"] for run in runs
                                                 if run["mean_response_length"] is not None]),
    }


def summarize(jppo_runs: list[dict], trl_runs: list[dict], first: int, alone_runs: Sequence[dict] = (),
              tunix_runs: Sequence[dict] = ()) -> dict:
    """Medians over steps ``first``.. of every run, per phase and for the whole step, and each peer's ratio; with
    ``alone_runs`` (:mod:`bench.trl_alone`, one per round) TRL's own step beside its in-harness one. A peer not
    run (no runs) has ``None`` for its step and ratio."""
    jppo_steps = [r for run in jppo_runs for r in run["records"] if r["step"] >= first]
    jppo_phases = sorted({k for r in jppo_steps for k in r if k.startswith("timing/")})
    ours = {k.removeprefix("timing/"): _median([r[k] for r in jppo_steps if r.get(k) is not None]) for k in jppo_phases}
    peers = {"trl": trl_runs, "tunix": list(tunix_runs)}
    rounds = [{"jppo": _median([r["timing/step"] for r in j["records"] if r["step"] >= first])} for j in jppo_runs]
    for side, side_runs in {**peers, "trl_alone": alone_runs}.items():
        for entry, run in zip(rounds, side_runs):
            entry[side] = _peer_step_median(run, first)
    runs = {"jppo": jppo_runs, **peers, "trl_alone": list(alone_runs)}
    summary = {
        "rounds_s_per_step": rounds, "trl_torch_threads": [run.get("torch_threads") for run in trl_runs],
        "jppo_s_per_step": ours.get("step"),
        "trl_alone_s_per_step": _median([s["step"] for run in alone_runs for s in run["steps"][first - 1:]]),
        "trl_alone_train_s": [run["train_s"] for run in alone_runs],
        "omp_wait_policy": {side: [run.get("omp_wait_policy") for run in side_runs]
                            for side, side_runs in runs.items() if side_runs},
        "jppo_phases_s": ours,
        "jppo_first_step_s": [run["records"][0]["timing/step"] for run in jppo_runs if run["records"]],
        "steps_in_medians": {"jppo": len(jppo_steps)} | {
            side: sum(len(run["steps"][first - 1:]) for run in side_runs) for side, side_runs in peers.items()},
        "jppo_mean_response_length": _median([r["response_length/mean"] for r in jppo_steps
                                              if r.get("response_length/mean") is not None]),
    }
    for side, side_runs in peers.items():
        summary |= _peer_summary(side, side_runs, first, ours)
    return summary


def prompt_ids(cfg: TrainConfig, count: int) -> list[list[int]]:
    """The ids of the task's first ``count`` training prompts, as both trainers encode them (BOS first)."""
    tokenizer = build.load_inputs(cfg).tokenizer
    examples = build.task_of(cfg.data).examples("train", count, cfg.trainer.seed)
    return [tokenizer.encode(example.prompt, add_special_tokens=True) for example in examples]


def check_logits(name: str, cfg: TrainConfig) -> float:
    """The largest logit difference of the two models on 4 of the task's prompts (cut to the shortest); an error
    above :data:`LOGITS_ATOL`."""
    rows = prompt_ids(cfg, 4)
    width = min(len(row) for row in rows)
    diff = logits_max_abs_diff(cfg.model.path, np.array([row[:width] for row in rows]))
    if diff > LOGITS_ATOL:
        raise RuntimeError(f"{name}: jppo and transformers logits differ by {diff:.2e} > {LOGITS_ATOL}")
    return diff


def describe(cfg: TrainConfig, overrides: Sequence[str], tunix: bool = False) -> dict:
    """The shape of one comparison, for the report (with ``tunix``, Tunix's batch settings too)."""
    batch = trl_arguments(cfg)
    lengths = [len(row) for row in prompt_ids(cfg, 64)]
    return {
        "overrides": [item for item in overrides if not item.startswith(("trainer.output_dir", "model.path"))],
        "layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size, "prompts": cfg.data.train_batch_size,
        "n": cfg.rollout.n, "max_response_length": cfg.rollout.max_response_length,
        "prompt_tokens": f"{min(lengths)}-{max(lengths)}", "vocab_size": build.load_inputs(cfg).tokenizer.vocab_size,
        "optimizer_steps_per_training_step": batch.pop("optimizer_steps_per_generation"),
        "ppo_epochs": cfg.actor.ppo_epochs, "trl_settings": batch,
    } | ({"tunix_settings": tunix_batches(cfg)} if tunix else {})


def measure_shape(name: str, shape: Shape, steps: int, rounds: int, omp: str = "user", alone: bool = False,
                  sides: Sequence[str] = PEERS) -> dict:
    """``rounds`` alternated runs of jppo and each peer of ``sides`` (and, with ``alone`` and TRL,
    :mod:`bench.trl_alone`) at ``shape``, ``steps`` training steps each, in OpenMP's ``omp`` environment
    (:func:`child_environment`), summarized."""
    # TRL imports vLLM where it is installed, and vLLM refuses to start when it finds libtpu (jax's TPU compiler, in
    # the test extra) beside its CPU build: the trainers run on this CPU (as jppo.rollout.vllm_engine tells vLLM)
    env = child_environment(omp)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with tempfile.TemporaryDirectory() as scratch:
        out = pathlib.Path(scratch)
        cfg, overrides = shape_config(shape, steps, out)
        diff = check_logits(name, cfg)
        runs: dict[str, list[dict]] = {"jppo": [], "trl": [], "trl_alone": [], "tunix": []}
        for index in range(rounds):  # alternated, one fresh process per run
            run_dir = out / f"jppo_{index}"
            runs["jppo"].append(run_side({"side": "jppo", "overrides": overrides + [f"trainer.output_dir={run_dir}"]},
                                         out / f"jppo_{index}.json", env))
            for side in sides:
                spec = {"overrides": overrides, "steps": steps, "out": str(out / f"{side}_{index}")}
                runs[side].append(run_side(spec | {"side": side}, out / f"{side}_{index}.json", env))
                if side == "trl" and alone:
                    runs["trl_alone"].append(run_side(spec | {"side": "trl_alone", "config": str(QUICKSTART_GRPO)},
                                                      out / f"trl_alone_{index}.json", env))
        shape_info = describe(cfg, overrides, tunix="tunix" in sides)
    tunix_diffs = [run["logits_max_abs_diff"] for run in runs["tunix"]]
    if any(d > LOGITS_ATOL for d in tunix_diffs):
        raise RuntimeError(f"{name}: jppo and Tunix logits differ by {max(tunix_diffs):.2e} > {LOGITS_ATOL}")
    first = MEDIAN_FROM if steps > MEDIAN_FROM else 2
    return summarize(runs["jppo"], runs["trl"], first, runs["trl_alone"], runs["tunix"]) | {
        "shape": shape_info, "logits_max_abs_diff": diff, "steps": steps, "rounds": rounds, "median_from_step": first,
        "tunix_logits_max_abs_diff": max(tunix_diffs) if tunix_diffs else None,
    }


def side_command(spec: dict, path: pathlib.Path) -> list[str]:
    """The command line of one run: ``python -m bench.trl_alone SPEC`` or ``python -m bench.peers --child SPEC``."""
    if spec["side"] == "trl_alone":
        return [sys.executable, "-m", "bench.trl_alone", str(path)]
    return [sys.executable, "-m", "bench.peers", "--child", str(path)]


def run_side(spec: dict, path: pathlib.Path, env: dict[str, str]) -> dict:
    """One run of ``spec["side"]`` (``jppo``: :func:`run_jppo`; ``trl``: :func:`bench.trl_side.run_trl` with
    torch's threads set to XLA's cores; ``trl_alone``: :mod:`bench.trl_alone`; ``tunix``:
    :func:`bench.tunix_side.run_tunix`) in a fresh Python process with
    environment ``env``, its result read back from ``SPEC.result``. Nothing of the other trainer (threads, heap,
    caches, allocations) is in that process. Its output goes to this process's stderr."""
    path.write_text(json.dumps(spec))
    subprocess.run(side_command(spec, path), cwd=ROOT, check=True, stdout=sys.stderr.fileno(), env=env)
    return json.loads(path.with_suffix(".result").read_text())


def child(path: pathlib.Path) -> None:
    """The body of :func:`run_side`'s process for ``jppo``, ``trl`` and ``tunix``."""
    spec = json.loads(path.read_text())
    cfg = load_config(QUICKSTART_GRPO, spec["overrides"])
    if spec["side"] == "jppo":
        result = run_jppo(cfg)
    elif spec["side"] == "tunix":
        rows = prompt_ids(cfg, 4)  # check_logits's prompts
        width = min(len(row) for row in rows)
        result = run_tunix(cfg, spec["steps"], pathlib.Path(spec["out"]), np.array([row[:width] for row in rows]))
    else:
        match_torch_threads()
        result = run_trl(cfg, spec["steps"], pathlib.Path(spec["out"]))
    result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    path.with_suffix(".result").write_text(json.dumps(result))


def measure(quick: bool, shapes: Sequence[str] = tuple(SHAPES), steps: Optional[int] = None,
            rounds: Optional[int] = None, omp: str = "user", alone: bool = False) -> dict:
    """Every shape's comparison (see the module docstring); a peer's ``None`` ratios and the reason without it."""
    missing = {"trl": trl_missing(), "tunix": tunix_missing()}
    sides = [side for side in PEERS if missing[side] is None]
    table = QUICK_SHAPES if quick else SHAPES
    result: dict = {"trl_missing": missing["trl"], "tunix_missing": missing["tunix"], "shapes": {}, "omp": omp}
    if sides:
        result["versions"] = {"torch": torch.__version__, "jax": jax.__version__}
        if "trl" in sides:
            import trl

            result["versions"]["trl"] = trl.__version__
        if "tunix" in sides:
            result["versions"]["tunix"] = tunix_version()
        result["torch_threads"] = match_torch_threads()
        for name in shapes:
            result["shapes"][name] = measure_shape(
                name, table[name], steps or (QUICK_STEPS if quick else FULL_STEPS),
                rounds or (1 if quick else FULL_ROUNDS), omp, alone, sides,
            )
    keys = {}
    for side in PEERS:
        for name in SHAPES:
            keys[f"e2e_vs_{side}_grpo_{name}"] = result["shapes"].get(name, {}).get(f"{side}_over_jppo")
    return result | keys


def argument_problem(args: argparse.Namespace, shapes: Sequence[str]) -> Optional[str]:
    """What is wrong with the arguments, in one line (``None``: nothing)."""
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown or not shapes:
        return f"--shapes={args.shapes}: must name some of {', '.join(SHAPES)}"
    if args.omp not in OMP_MODES:
        return f"--omp={args.omp}: must be one of {', '.join(OMP_MODES)}"
    if args.steps is not None and args.steps < 2:
        return f"--steps={args.steps} must be >= 2 (a step's time is measured from the previous step's end)"
    if args.rounds is not None and args.rounds < 1:
        return f"--rounds={args.rounds} must be >= 1"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 steps (a smoke run)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, help=f"training steps per run (default {FULL_STEPS}, quick {QUICK_STEPS})")
    parser.add_argument(
        "--rounds", type=int, help=f"alternated jppo/TRL/Tunix runs per shape (default {FULL_ROUNDS}, quick 1)"
    )
    parser.add_argument("--omp", default="user", help="OMP_WAIT_POLICY of the trainer processes: user (as this "
                        "shell has it; default) or passive (bench's default for its in-process comparisons)")
    parser.add_argument("--alone", action="store_true",
                        help="also run TRL by itself (bench.trl_alone) after its in-harness run of every round")
    parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)  # one run_side process
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child)
        return 0
    shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
    problem = argument_problem(args, shapes)
    if problem is not None:
        print(f"bench.peers: error: {problem}", file=sys.stderr)
        return 2
    result = measure(args.quick, shapes, args.steps, args.rounds, args.omp, args.alone)
    print(section("peers", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
