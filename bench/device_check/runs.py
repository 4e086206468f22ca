"""Device-check stages that train: 5 quickstart steps, and one GRPO step of a Qwen2.5-0.5B-shaped random model with
its per-phase times, tokens/s and the device's measured peak beside ``jppo.plan``'s.

    python -m bench.device_check.runs quickstart|grpo_step --out DIR [--cpu]

Both run ``jppo.train``'s command in this process (so the device's peak is this process's), on the image's own jax.
The GRPO step needs no download and no tokenizer package beyond ``tokenizers``: its model is written at random
(``bench.real_size.write_model``) with a byte-level tokenizer of the model's whole vocabulary
(:func:`write_tokenizer`), its prompts generated (``bench.real_size.word_problems``).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

from bench.device_check.stage import OutOfTime, device_peak_bytes, main

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Models, prompts and run folders (checkpoints of a 0.5B model: GBs) go here, never into the JSON folder, which
# travels back from a lent machine.
WORK = pathlib.Path(os.environ.get("DEVICE_CHECK_WORK", pathlib.Path(tempfile.gettempdir()) / "jppo-device-check"))
COMMON = ["trainer.logger=[console,jsonl]", "trainer.plots=false", "trainer.progress_bar=false",
          "trainer.resume=never", "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false"]


def train(config: str, overrides: list[str], output: pathlib.Path) -> tuple[list[dict], float]:
    """``python -m jppo.train --config CONFIG OVERRIDES`` in this process; its metrics.jsonl rows and wall seconds."""
    from jppo import train as command  # noqa: PLC0415
    from jppo.parallel.preemption import PREEMPTED_EXIT  # noqa: PLC0415

    shutil.rmtree(output, ignore_errors=True)
    started = time.perf_counter()
    status = command.main(["--config", str(ROOT / config), *COMMON, *overrides, f"trainer.output_dir={output}"])
    wall = time.perf_counter() - started
    if status == PREEMPTED_EXIT:  # jppo.train stops on SIGTERM, which is how the stage's box ends it
        raise OutOfTime(f"jppo.train stopped on SIGTERM (status {status}): the stage ran out of its box")
    if status != 0:
        raise RuntimeError(f"jppo.train exited with status {status}")
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(output, ignore_errors=True)
    return rows, wall


def phases(row: dict) -> dict:
    return {key: value for key, value in row.items() if key.startswith(("timing/", "perf/"))}


def quickstart(cpu: bool, out: pathlib.Path) -> dict:
    """``configs/quickstart.yaml`` (PPO, critic, GAE) for 5 steps (2 on CPU); the first step includes compilation."""
    steps = 2 if cpu else 5
    rows, wall = train("configs/quickstart.yaml", [f"trainer.total_steps={steps}"], WORK / "quickstart_run")
    return {
        "steps": len(rows), "wall_s_including_start": wall,
        "timing_step_s": [row.get("timing/step") for row in rows],
        "reward_mean": [row.get("reward/mean") for row in rows],
        "last_step": {k: v for k, v in rows[-1].items() if k.startswith(("timing/", "perf/", "actor/", "critic/"))},
        "device_peak_bytes": device_peak_bytes(),
    }


def write_tokenizer(directory: pathlib.Path, vocab_size: int) -> dict[str, int]:
    """A byte-level BPE of exactly ``vocab_size`` ids without merges (each byte a token; the rest are unused
    fillers, as most of a real vocabulary is to a short prompt) and Qwen's chat tokens; returns their ids."""
    import tokenizers  # noqa: PLC0415

    from bench.real_size import CHAT_TOKENS, save_chat_tokenizer  # noqa: PLC0415

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab |= {f"<unused_{i}>": i for i in range(len(vocab), vocab_size - len(CHAT_TOKENS))}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    ids = save_chat_tokenizer(tokenizer, directory)
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    return ids


# One GRPO step's shape on a GPU: 16 prompts x 4 responses of up to 256 tokens, token-budget micro-batches.
GPU_SHAPE = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "rollout.n=4", "data.max_prompt_length=128",
             "rollout.prompt_bucket=64", "rollout.max_response_length=256", "actor.ppo_max_token_len=4096",
             "actor.log_prob_chunk_size=256", "model.attention=auto"]
CPU_MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=4096)


def grpo_step(cpu: bool, out: pathlib.Path) -> dict:
    """One GRPO step of ``configs/qwen2_5_0_5b_gsm8k_grpo.yaml`` on a random model of Qwen2.5-0.5B's shape (a tiny
    one of the same family on CPU), one device: ``timing/*`` per phase, tokens/s, and the device's peak bytes next
    to ``jppo.plan``'s peak for the same config."""
    from bench import real_size  # noqa: PLC0415
    from jppo.config import check_mesh, load_config  # noqa: PLC0415
    from jppo.plan import as_json  # noqa: PLC0415
    from jppo.preflight.memory import memory_plan  # noqa: PLC0415

    shape = {**real_size.QWEN2_5_0_5B, **(CPU_MODEL if cpu else {})}
    model, data = WORK / "grpo_model", WORK / "grpo_prompts.jsonl"
    real_size.write_model(model, write_tokenizer(model, shape["vocab_size"]), shape)
    data.write_text("".join(json.dumps(row) + "\n" for row in real_size.word_problems(64)))
    overrides = (real_size.OVERRIDES if cpu else [*real_size.OVERRIDES, *GPU_SHAPE]) + [
        f"model.path={model}", f"data.train_files={data}", "trainer.total_steps=1"]
    plan = as_json(memory_plan(cfg := load_config(str(ROOT / real_size.CONFIG), [*COMMON, *overrides]),
                               check_mesh(cfg, 1)))
    rows, wall = train(real_size.CONFIG, overrides, WORK / "grpo_run")
    measured = device_peak_bytes()
    shutil.rmtree(model, ignore_errors=True)
    return {
        "model": {k: shape[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                        "num_kv_heads")},
        "overrides": overrides[:-3], "wall_s_including_start": wall, "phases": phases(rows[-1]),
        "tokens_per_s": rows[-1].get("perf/tokens_per_s"),
        "device_peak_bytes": measured, "plan_peak_bytes": plan["peak_bytes"],
        "measured_over_plan": measured / plan["peak_bytes"] if measured else None, "plan": plan,
    }


if __name__ == "__main__":
    sys.exit(main({"quickstart": quickstart, "grpo_step": grpo_step}))
