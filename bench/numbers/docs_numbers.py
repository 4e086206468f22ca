"""The numbers README.md and docs/ quote, measured or planned in one place: ``docs/measured/numbers.json``.

    python -m bench.numbers.docs_numbers [--runs DIR] [--only quickstart,dapo,...] [--pages]

Runs each quickstart config of ``RUNS`` to its end (``python -m jppo.train``, one subprocess each, into
``DIR/<name>``; a run already complete there is read, not rerun) as the README's command runs on a fresh machine
(no XLA flags: one CPU device, recorded with each run; the quickstart over seeds 0, 1 and 2, quoted as a median
and a range, since 400 steps of RL amplify float32 rounding into different runs), the SFT-then-GRPO comparison
(``python -m bench.numbers.sft_to_rl`` into ``DIR/sft_to_rl``, read when its result is there), plans the GSM8K
configs on one device (``jppo.preflight.memory``, nothing allocated), and writes ``docs/measured/numbers.json`` (each
number as the pages quote it) and ``docs/measured/README.md`` (the same with where each comes from). A page quotes
a number as ``<!--m:KEY-->VALUE``; ``tests/test_docs.py`` checks that every such VALUE is the file's, and
``--pages`` rewrites them from it. Times are recorded with the machine's load: they are not quoted, since a shared
machine inflates them, but for the SFT run's (seconds for its 100 steps, compilation included; the file records the
load it ran under).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEASURED = ROOT / "docs" / "measured"
NUMBERS = MEASURED / "numbers.json"
PAGES = ("README.md", "docs/*.md")
# ``<!--m:KEY-->VALUE``: an HTML comment (not rendered) naming the key of the number that follows it
MARKER = re.compile(r"<!--m:([a-z0-9_.]+)-->(-?\d+(?:\.\d+)?%?)")
GIB, MIB = 2**30, 2**20

# name: (config, overrides): each run as its page describes it
RUNS = {
    "quickstart": ("configs/quickstart.yaml", ()),
    "quickstart_seed1": ("configs/quickstart.yaml", ("trainer.seed=1",)),
    "quickstart_seed2": ("configs/quickstart.yaml", ("trainer.seed=2",)),
    "dapo": ("configs/quickstart_dapo.yaml", ()),
    "lora": ("configs/quickstart_lora.yaml", ()),
    "moe": ("configs/quickstart_moe.yaml", ()),
}
GSM8K = {"grpo": "configs/qwen2_5_0_5b_gsm8k_grpo.yaml", "ppo": "configs/qwen2_5_0_5b_gsm8k_ppo.yaml"}
# docs/lora.md's table: the GRPO config's terms with full fine-tuning (GiB) and with LoRA (rank 16, every
# projection; in the unit each term's column shows it)
LORA = ("actor.lora.rank=16", "actor.lora.alpha=32")
LORA_TERMS = {"parameters/actor": GIB, "parameters/reference": MIB, "optimizer_state/actor": MIB,
              "gradients/actor": MIB, "optimizer_step/actor": MIB}


def two(x: float) -> str:
    return f"{x:.2f}"


def percent(x: float) -> str:
    return f"{round(100 * x)}%"


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def complete(run_dir: pathlib.Path, total_steps: int) -> bool:
    rows = read_metrics(run_dir)
    return bool(rows) and rows[-1]["step"] == total_steps


def first_last(rows: list[dict], key: str, n: int = 10) -> tuple[float, float]:
    """The mean of ``key`` over the first ``n`` and the last ``n`` steps."""
    return statistics.mean(r[key] for r in rows[:n]), statistics.mean(r[key] for r in rows[-n:])


def reward_numbers(rows: list[dict]) -> dict[str, str]:
    """The curve (``reward/mean``, first and last 10 steps) and the last validation: greedy reward, and the share of
    held-out prompts answered exactly (``val/accuracy``)."""
    first, last = first_last(rows, "reward/mean")
    val = [r for r in rows if "val/reward/mean" in r][-1]
    return {"reward_first10": two(first), "reward_last10": two(last), "greedy": two(val["val/reward/mean"]),
            "exact": percent(val["val/accuracy"])}


def dapo_numbers(rows: list[dict]) -> dict[str, str]:
    """The shaped reward's curve and dynamic sampling's averages over the run."""
    first, last = first_last(rows, "reward/mean")
    batches = [r["filter_groups/num_gen_batches"] for r in rows]
    return {"reward_first10": two(first), "reward_last10": two(last),
            "batches_min": str(round(min(batches))), "batches_max": str(round(max(batches))),
            "batches_mean": two(statistics.mean(batches)),
            "varied": percent(statistics.mean(r["filter_groups/varied_fraction"] for r in rows)),
            "kept": percent(statistics.mean(r["filter_groups/kept_fraction"] for r in rows))}


def moe_numbers(rows: list[dict]) -> dict[str, str]:
    """:func:`reward_numbers`, the greedy reward at each validation (``greedy<step>``), the expert load
    (``actor/expert_load``: 1 is even) over the first and the last 10 steps, and the training's seconds."""
    first, last = first_last(rows, "actor/expert_load")
    greedy = {f"greedy{r['step']}": two(r["val/reward/mean"]) for r in rows if "val/reward/mean" in r}
    seconds = str(round(sum(r.get("timing/step", 0.0) for r in rows)))
    return reward_numbers(rows) | greedy | {"expert_load_first10": two(first), "expert_load_last10": two(last),
                                            "training_s": seconds}


SUMMARIES: dict[str, Callable[[list[dict]], dict[str, str]]] = {
    "quickstart": reward_numbers, "quickstart_seed1": reward_numbers, "quickstart_seed2": reward_numbers,
    "dapo": dapo_numbers, "lora": reward_numbers, "moe": moe_numbers,
}
SEEDS = ("quickstart", "quickstart_seed1", "quickstart_seed2")  # the README's command, seeds 0, 1 and 2


def spread_numbers(numbers: dict[str, str]) -> dict[str, str]:
    """The quickstart over :data:`SEEDS`: the median, lowest and highest of each of its numbers."""
    out = {}
    for key in ("reward_first10", "reward_last10", "greedy", "exact"):
        values = [numbers[f"{name}.{key}"] for name in SEEDS]
        as_float = [float(v.rstrip("%")) for v in values]
        unit = "%" if values[0].endswith("%") else ""
        show = (lambda x: f"{round(x)}%") if unit else two
        out |= {f"quickstart_seeds.{key}_median": show(statistics.median(as_float)),
                f"quickstart_seeds.{key}_min": show(min(as_float)), f"quickstart_seeds.{key}_max": show(max(as_float))}
    return out


def default_machine() -> dict[str, str]:
    """The environment of the README's command on a fresh machine: no XLA flags (one CPU device), the CPU platform
    (as there without libtpu)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    return env | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def device_count(env: dict[str, str]) -> int:
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"], env=env,
                           capture_output=True, text=True, check=True)
    return int(probe.stdout.split()[-1])


def run(name: str, runs: pathlib.Path) -> dict:
    """Trains run ``name`` into ``runs/name`` unless it is complete there; its numbers and how it was measured."""
    from jppo.config import load_config  # noqa: PLC0415 (only to read total_steps)

    config, overrides = RUNS[name]
    out = runs / name
    total = load_config(ROOT / config, list(overrides)).trainer.total_steps
    wall = None
    if not complete(out, total):
        command = [sys.executable, "-m", "jppo.train", "--config", str(ROOT / config), *overrides,
                   f"trainer.output_dir={out}", "trainer.progress_bar=false"]
        start = time.perf_counter()
        subprocess.run(command, check=True, cwd=ROOT, env=default_machine())
        wall = round(time.perf_counter() - start, 1)
    rows = read_metrics(out)
    numbers = {f"{name}.{key}": value for key, value in SUMMARIES[name](rows).items()}
    source = {"command": f"python -m jppo.train --config {config} {' '.join(overrides)}".strip(), "steps": total,
              "training_s": round(sum(r.get("timing/step", 0.0) for r in rows), 1), "wall_s": wall,
              "devices": device_count(default_machine())}
    return {"numbers": numbers, "source": source}


# bench.numbers.sft_to_rl's defaults: the GRPO runs' validation steps the pages quote
SFT_TO_RL_STEPS, SFT_TO_RL_VAL_EVERY = 100, 20


def sft_to_rl_numbers(result: dict) -> dict[str, str]:
    """``bench.numbers.sft_to_rl``'s result as the pages quote it: the SFT run's steps, seconds and held-out NLL
    (first and last validation) and greedy score (first and last); each GRPO run's held-out greedy score at every
    validation step and its training reward over the first and last 10 steps."""
    sft = result["sft"]
    nll = list(sft["val_sft_nll"].values())
    numbers = {"sft_steps": str(sft["steps"]), "sft_seconds": str(round(sft["seconds"])),
               "sft_nll_first": two(nll[0]), "sft_nll_last": two(nll[-1]),
               "sft_greedy_first": two(list(sft["val_score"].values())[0]),
               "sft_greedy": two(list(sft["val_score"].values())[-1])}
    for name in ("from_sft", "from_scratch"):
        run_ = result[f"grpo_{name}"]
        numbers.update({f"{name}_greedy{step}": two(score) for step, score in run_["val_score"].items()})
        rewards = list(run_["reward"].values())
        numbers[f"{name}_reward_first10"] = two(statistics.mean(rewards[:10]))
        numbers[f"{name}_reward_last10"] = two(statistics.mean(rewards[-10:]))
    return {f"sft_to_rl.{key}": value for key, value in numbers.items()}


def sft_to_rl(runs: pathlib.Path) -> dict:
    """``python -m bench.numbers.sft_to_rl`` into ``runs/sft_to_rl`` unless its result is there; its numbers and
    source."""
    out = runs / "sft_to_rl"
    path = out / "sft_to_rl.json"
    if not path.is_file():
        command = [sys.executable, "-m", "bench.numbers.sft_to_rl", "--out", str(out), f"--steps={SFT_TO_RL_STEPS}",
                   f"--val-every={SFT_TO_RL_VAL_EVERY}"]
        subprocess.run(command, check=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    result = json.loads(path.read_text())
    source = {"command": "python -m bench.numbers.sft_to_rl", "steps": SFT_TO_RL_STEPS,
              "training_s": round(result["sft"]["seconds"], 1), "wall_s": None,
              "load_average": round(result.get("load_average", 0.0), 1)}
    return {"numbers": sft_to_rl_numbers(result), "source": source}


def plan_numbers() -> dict[str, str]:
    """The GSM8K configs planned on one device with the overrides their pages give for it (``mesh.sequence=1``,
    4096-token rows): the peak, the sampler's KV caches, and the peak with the reference kept in float32; for GRPO,
    the terms of :data:`LORA_TERMS` and the peak without and with LoRA (``plan.grpo_1device[_lora]_<term>``)."""
    from bench.numbers.plan_table import MODELS, write_checkpoints  # noqa: PLC0415
    from jppo.config import check_mesh, load_config  # noqa: PLC0415
    from jppo.preflight.memory import memory_plan  # noqa: PLC0415

    numbers = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        path = write_checkpoints(root)[next(iter(MODELS))]  # Qwen2.5-0.5B's config.json
        prompts = root / "prompts.jsonl"
        files = [f"model.path={path}", f"data.train_files={prompts}", f"data.val_files={prompts}",
                 "model.tokenizer=builtin:reverse_digits", "mesh.sequence=1"]
        for name, config in GSM8K.items():
            budgets = ["actor.ppo_max_token_len=4096"] + (["critic.ppo_max_token_len=4096"] if name == "ppo" else [])
            for suffix, extra in (("", []), ("_ref_float32", ["ref.param_dtype=float32"])):
                cfg = load_config(ROOT / config, [*files, *budgets, *extra])
                plan = memory_plan(cfg, check_mesh(cfg, 1))
                numbers[f"plan.{name}_1device{suffix}"] = two(plan.peak_bytes / GIB)
                if not suffix:
                    kv = {t.name: t.bytes for t in plan.rollout}["kv_cache"]
                    numbers[f"plan.{name}_1device_kv_cache"] = two(kv / GIB)
                    full = plan
            if name == "grpo":
                cfg = load_config(ROOT / config, [*files, *budgets, *LORA])
                lora = memory_plan(cfg, check_mesh(cfg, 1))
                numbers["plan.grpo_1device_lora"] = two(lora.peak_bytes / GIB)
                for term, unit in LORA_TERMS.items():
                    key = term.replace("/", "_")
                    numbers[f"plan.grpo_1device_{key}"] = two(full.term(term) / GIB)
                    numbers[f"plan.grpo_1device_lora_{key}"] = two(lora.term(term) / unit)
    return numbers


def quoted(text: str) -> list[tuple[str, str]]:
    """``(key, value)`` of every marked number of a page."""
    return MARKER.findall(text)


def page_paths() -> list[pathlib.Path]:
    return sorted({path for pattern in PAGES for path in ROOT.glob(pattern)})


def rewrite(text: str, numbers: dict[str, str]) -> str:
    """The page with every marked number replaced by the file's (a key the file lacks is left as it is)."""
    return MARKER.sub(lambda m: f"<!--m:{m[1]}-->{numbers.get(m[1], m[2])}", text)


def markdown(record: dict) -> str:
    lines = ["# Measured and planned numbers", "",
             "Generated by `python -m bench.numbers.docs_numbers` (do not edit): the numbers README.md and docs/ "
             "quote, each quoted there as `<!--m:KEY-->VALUE` and checked by `tests/test_docs.py`.", "",
             f"Machine: {record['machine']}.", "", "| key | value | from |", "|---|---|---|"]
    for key, value in record["numbers"].items():
        lines.append(f"| `{key}` | {value} | {record['sources'].get(key.split('.')[0], 'jppo.preflight.memory')} |")
    lines += ["", "Runs (the training time is the sum of `timing/step`; a shared machine inflates it):", ""]
    for name, source in record["runs"].items():
        lines.append(f"- `{name}`: `{source['command']}`, {source['steps']} steps, {source['training_s']} s of "
                     f"training" + (f", {source['wall_s']} s wall" if source["wall_s"] else "")
                     + (f", {source['devices']} device(s)" if "devices" in source else "")
                     + (f", load average {source['load_average']}" if "load_average" in source else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.numbers.docs_numbers", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/docs", help="where the runs go, or are read when complete")
    parser.add_argument("--only", help=f"comma-separated: {','.join(RUNS)},sft_to_rl,plan (default: all; the rest "
                                       "kept)")
    parser.add_argument("--pages", action="store_true", help="rewrite the marked numbers of README.md and docs/")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else {*RUNS, "sft_to_rl", "plan"}
    old = json.loads(NUMBERS.read_text()) if NUMBERS.is_file() else {"numbers": {}, "runs": {}}
    numbers, runs = dict(old["numbers"]), dict(old["runs"])
    for name in RUNS:
        if name in only:
            result = run(name, pathlib.Path(args.runs).resolve())
            numbers.update(result["numbers"])
            runs[name] = result["source"]
    if all(f"{name}.greedy" in numbers for name in SEEDS):
        numbers.update(spread_numbers(numbers))
    if "sft_to_rl" in only:
        result = sft_to_rl(pathlib.Path(args.runs).resolve())
        numbers.update(result["numbers"])
        runs["sft_to_rl"] = result["source"]
    if "plan" in only:
        numbers.update(plan_numbers())
    machine = (f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} when generated, "
               f"{time.strftime('%Y-%m-%d', time.gmtime())}")
    record = {"machine": machine if only & set(RUNS) else old.get("machine", machine),
              "numbers": dict(sorted(numbers.items())), "runs": runs}
    record["sources"] = {name: f"`{source['command']}`" for name, source in runs.items()}
    MEASURED.mkdir(exist_ok=True)
    NUMBERS.write_text(json.dumps(record, indent=2) + "\n")
    (MEASURED / "README.md").write_text(markdown(record))
    if args.pages:
        for path in page_paths():
            text = path.read_text()
            if rewrite(text, record["numbers"]) != text:
                path.write_text(rewrite(text, record["numbers"]))
                print(f"rewrote {path.relative_to(ROOT)}")
    print(f"wrote {NUMBERS.relative_to(ROOT)} ({len(numbers)} numbers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
