"""``python -m jppo.export``: a run's policy as a Hugging Face directory that transformers loads and generates from
as jppo does (greedy tokens equal), with its tokenizer and generation config, sharded and in the source's dtype."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from flax import nnx

from jppo.config import check_mesh, load_config, save_config
from jppo.data import load_tokenizer
from jppo.export import main
from jppo.models import load_pretrained
from jppo.parallel.mesh import make_mesh
from jppo.rollout import SamplingParams, generate, pad_prompts
from jppo.run import build
from jppo.run.checkpoint import CheckpointManager
from jppo.run.lifecycle import save
from jppo.run.loop import run, setup

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SMALL = [
    "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size=1", "critic.ppo_micro_batch_size=1", "trainer.val_every=0", "trainer.plots=false",
    "trainer.logger=[jsonl]",
]
PROMPTS = ["3051=", "12345=", "907=", "8642="]
MAX_NEW_TOKENS = 6


def jppo_greedy(model, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    """jppo's sampler at temperature 0: each prompt's response tokens, up to and including EOS."""
    ids, mask = pad_prompts(prompts, tokenizer.pad_id, multiple=8)
    params = SamplingParams(MAX_NEW_TOKENS, greedy=True, eos_token_ids=tokenizer.eos_ids, pad_token_id=tokenizer.pad_id)
    out = generate(model, ids, mask, jax.random.key(0), params)
    tokens, kept = np.asarray(out.response_ids), np.asarray(out.response_mask)
    return [row[keep].tolist() for row, keep in zip(tokens, kept)]


def transformers_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """``generate`` with the exported generation config (its EOS list and PAD), one prompt at a time."""
    out = []
    for prompt in prompts:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        out.append(tokens[0, len(prompt):].tolist())
    return out


def test_quickstart_run_exports_a_directory_transformers_loads_and_generates_from_as_jppo(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    cfg = load_config(QUICKSTART, [*SMALL, f"trainer.output_dir={run_dir}", "trainer.total_steps=1",
                                   "trainer.export_hf=true"])
    inputs = build.load_inputs(cfg)
    run(cfg, check_mesh(cfg, jax.device_count()), inputs)
    assert main([str(run_dir), str(out)]) == 0

    # jppo's trained policy as the trainer itself resumes it
    state, _, _, graphdef = setup(cfg, make_mesh(*check_mesh(cfg, jax.device_count())), inputs)
    with CheckpointManager(run_dir / "checkpoints") as manager:
        state, _ = manager.restore(1, state)
    policy = nnx.merge(graphdef, state.actor.params)

    tokenizer = inputs.tokenizer
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS]
    assert [hf_tokenizer(text).input_ids for text in PROMPTS] == prompts
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_model.dtype == torch.float32  # the source (a float32 model trained from scratch) dtype is kept
    expected = jppo_greedy(policy, tokenizer, prompts)
    assert transformers_greedy(hf_model, prompts) == expected
    assert [hf_tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected] == [
        tokenizer.decode(tokens) for tokens in expected
    ]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(tokenizer.eos_ids) and generation["pad_token_id"] == tokenizer.pad_id
    # the trainer's end-of-run export writes the same directory
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == sorted(p.name for p in out.iterdir())
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (run_dir / "hf" / name).read_bytes() == (out / name).read_bytes(), name


def char_tokenizer_dir(path: pathlib.Path, alphabet: str) -> dict[str, int]:
    """A small Hugging Face tokenizer (one token per character, two EOS tokens like Qwen's); returns its vocab."""
    specials = ["<pad>", "<|endoftext|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate([*specials, *alphabet])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<pad>", "chat_template": "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}",
    }))
    return vocab


def test_bfloat16_qwen2_checkpoint_exports_sharded_in_bfloat16_and_generates_as_jppo(tmp_path):
    source, run_dir, out = tmp_path / "source", tmp_path / "run", tmp_path / "hf"
    source.mkdir()
    vocab = char_tokenizer_dir(source, "0123456789=")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|endoftext|>"],
    )
    reference = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    reference.save_pretrained(source)
    eos = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "temperature": 0.7}))

    # a run on that checkpoint (float32 training of the bfloat16 weights), checkpointed at step 0
    cfg = load_config(QUICKSTART, [*SMALL, f"model.path={source}", f"trainer.output_dir={run_dir}"])
    inputs = build.load_inputs(cfg)
    state, _, _, _ = setup(cfg, make_mesh(*check_mesh(cfg, jax.device_count())), inputs)
    run_dir.mkdir()
    save_config(cfg, run_dir / "config.yaml")
    with CheckpointManager(run_dir / "checkpoints") as manager:
        save(manager, state, cfg)
    assert main([str(run_dir / "checkpoints" / "0"), str(out), "--max-shard-size", "20KB"]) == 0

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / name).is_file() for name in shards)
    assert not (out / "model.safetensors").exists()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert exported.dtype == torch.bfloat16
    for name, tensor in reference.state_dict().items():  # bfloat16 -> float32 -> bfloat16 is exact
        assert torch.equal(exported.state_dict()[name], tensor), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos and generation["temperature"] == 0.7
    assert generation["pad_token_id"] == vocab["<pad>"]

    tokenizer = load_tokenizer(str(source))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    assert [hf_tokenizer(text).input_ids for text in PROMPTS] == prompts
    policy = load_pretrained(source)  # float32, as the run trains it
    as_float32 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert transformers_greedy(as_float32, prompts) == jppo_greedy(policy, tokenizer, prompts)


def test_export_errors_are_one_line_with_status_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "empty"), str(tmp_path / "out")], "neither a run directory"),
        ([str(tmp_path / "missing"), str(tmp_path / "out")], "neither a run directory"),
        ([str(tmp_path / "empty"), str(tmp_path / "out"), "--max-shard-size", "2 parsecs"], "--max-shard-size"),
    ]
    for argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("jppo.export: error:") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, size", [("2GB", 2 * 10**9), ("20KB", 20_000), ("1GiB", 2**30), ("512", 512)])
def test_max_shard_size_reads_transformers_units(text, size):
    from jppo.run.export import parse_size

    assert parse_size(text) == size
