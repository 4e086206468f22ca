"""The README's table of planned peak memory per device: model size x H200 count x full fine-tuning / LoRA.

    python -m bench.numbers.plan_table [--markdown]

Each cell is ``python -m jppo.plan``'s peak (:func:`jppo.preflight.memory.memory_plan`) for
``configs/qwen2_5_0_5b_gsm8k_grpo.yaml`` (GRPO, 128 prompts x 5, prompts 512 + responses 512 tokens, token budget
4096, bfloat16 compute over float32 weights, remat, KL loss: a reference policy, FSDP over every device) with the
model's shape taken from its Hugging Face ``config.json`` (written here from the numbers below; no weights are
read or downloaded). LoRA: rank 64 on every projection (``actor.lora.rank=64``). A cell is marked when the peak
exceeds what JAX's allocator takes of an H200 (0.75 of its 141 GB, :func:`jppo.preflight.fit.allocator_bytes`).
Nothing is measured: the plan's terms and how they compared with a measured run are in ``jppo/preflight/memory.py`` and
``bench/real_size.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

from jppo.config import check_mesh, load_config
from jppo.preflight.fit import allocator_bytes
from jppo.preflight.memory import memory_plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "qwen2_5_0_5b_gsm8k_grpo.yaml"
H200_BYTES = 141 * 10**9  # HBM3e per H200
DEVICES = (1, 2, 4, 8)
LORA = ("actor.lora.rank=64", "actor.lora.alpha=128")

# The shapes of each model's config.json (Hugging Face: Qwen/Qwen2.5-*-Instruct, meta-llama/Llama-3.1-8B-Instruct).
FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "tie_word_embeddings", "rope_theta")
MODELS = {
    "Qwen2.5-0.5B": ("qwen2", 151936, 896, 4864, 24, 14, 2, True, 1e6),
    "Qwen2.5-1.5B": ("qwen2", 151936, 1536, 8960, 28, 12, 2, True, 1e6),
    "Qwen2.5-3B": ("qwen2", 151936, 2048, 11008, 36, 16, 2, True, 1e6),
    "Qwen2.5-7B": ("qwen2", 152064, 3584, 18944, 28, 28, 4, False, 1e6),
    "Llama-3.1-8B": ("llama", 128256, 4096, 14336, 32, 32, 8, False, 5e5),
}
COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=32768, hidden_act="silu", torch_dtype="bfloat16")


def write_checkpoints(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """One directory per model holding only its ``config.json`` (all the plan reads), plus one prompt file."""
    paths = {}
    for name, shape in MODELS.items():
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(COMMON | dict(zip(FIELDS, shape))))
        paths[name] = path
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "1 + 1 = ?", "answer": "#### 2"}) + "\n")
    return paths


def peaks(root: pathlib.Path) -> dict[str, dict[str, dict[int, int]]]:
    """``{model: {"full" | "lora": {devices: peak bytes per device}}}``."""
    prompts = root / "prompts.jsonl"
    common = [f"data.train_files={prompts}", f"data.val_files={prompts}", "model.tokenizer=builtin:reverse_digits",
              f"trainer.output_dir={root / 'run'}",
              # the shipped budget, 4096-token rows not split over devices, held here should the config change
              "mesh.sequence=1", "actor.ppo_max_token_len=4096"]
    out = {}
    for name, path in write_checkpoints(root).items():
        out[name] = {}
        for kind, extra in (("full", ()), ("lora", LORA)):
            row = {}
            for devices in DEVICES:
                cfg = load_config(CONFIG, [f"model.path={path}", *common, *extra])
                row[devices] = memory_plan(cfg, check_mesh(cfg, devices)).peak_bytes
            out[name][kind] = row
    return out


def markdown(table: dict[str, dict[str, dict[int, int]]]) -> str:
    limit = allocator_bytes(H200_BYTES, {})
    header = "| model | fine-tuning | " + " | ".join(f"{d} H200" for d in DEVICES) + " |"
    lines = [header, "|---|---|" + "---:|" * len(DEVICES)]
    for name, kinds in table.items():
        for kind, row in kinds.items():
            cells = [f"{row[d] / 2**30:.1f} GiB" + (" (over)" if row[d] > limit else "") for d in DEVICES]
            lines.append(f"| {name} | {'full' if kind == 'full' else 'LoRA r64'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.numbers.plan_table", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the README's table (default: JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        table = peaks(pathlib.Path(root))
    print(markdown(table) if args.markdown else json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
