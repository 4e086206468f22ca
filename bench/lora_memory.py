"""Per-device memory of the 0.5B GRPO config with and without LoRA, from the memory plan (``jppo.plan``).

``python -m bench.lora_memory [--devices N] [--rank R]``: writes Qwen2.5-0.5B-Instruct's ``config.json`` (no
weights: the plan reads shapes only) and a two-row data file into a temporary directory, plans
``configs/qwen2_5_0_5b_gsm8k_grpo.yaml`` on it with ``actor.lora.rank=0`` and with ``actor.lora.rank=R`` (every
projection, alpha 2R), and prints the parameter, optimizer-state, gradient and peak bytes per device of each.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

from bench.real_size import QWEN2_5_0_5B
from jppo.config import check_mesh, load_config
from jppo.models import ModelConfig
from jppo.preflight.memory import human, memory_plan

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_0_5b_gsm8k_grpo.yaml"
TERMS = ("parameters/actor", "parameters/reference", "optimizer_state/actor", "gradients/actor",
         "optimizer_step/actor")


def plans(devices: int, rank: int) -> dict[str, dict[str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        model, data = pathlib.Path(tmp) / "model", pathlib.Path(tmp) / "rows.jsonl"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(ModelConfig(**QWEN2_5_0_5B).to_hf()))
        data.write_text('{"prompt": "1+1?", "answer": "#### 2"}\n' * 2)
        base = [f"model.path={model}", "model.tokenizer=builtin:reverse_digits", f"data.train_files={data}",
                f"data.val_files={data}", "data.apply_chat_template=false",
                # the 4096-token rows of one device (docs/lora.md), not the config's context-parallel 8-device mesh
                "mesh.sequence=1", "actor.ppo_max_token_len=4096"]
        out = {}
        for name, lora in (("full", ["actor.lora.rank=0"]), (f"lora r={rank}",
                           [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}"])):
            cfg = load_config(CONFIG, [*base, *lora])
            plan = memory_plan(cfg, check_mesh(cfg, devices))
            out[name] = {term: plan.term(term) for term in TERMS} | {"peak": plan.peak_bytes}
        return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    result = plans(args.devices, args.rank)
    print(f"{'bytes per device':<24}" + "".join(f"{name:>16}" for name in result))
    for term in [*TERMS, "peak"]:
        print(f"{term:<24}" + "".join(f"{human(values[term]):>16}" for values in result.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
