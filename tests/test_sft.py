"""Supervised fine-tuning (python -m jppo.sft) keeps the contract, reads its data as transformers does, refuses bad
rows in one line before anything compiles, and hands its policy to an RL run.

The update is checked against a from-scratch whole-batch reference that never touches the engine: the model run
once over the rows in their padded layout, ``-log p`` of the loss tokens averaged as the mode says, differentiated
by ``jax.grad``. float32, so the engine and the reference differ by summation order only (rtol 1e-5).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from engine_cases import mesh_of, padded_inputs, tiny_config
from flax import nnx

from jppo import sft as sft_command
from jppo.config import load_config
from jppo.core.settings import OptimConfig
from jppo.data.sft import SFTData, SFTRow, load_sft_data, tokenize_row
from jppo.data.tokenizer import HFTokenizer
from jppo.engine import ActorConfig, UpdateStep, init_train_state, run_updates, sft_loss_fn
from jppo.models.decoder import CausalLM
from jppo.models.sharding import create_model
from jppo.run import sft as sft_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart_sft.yaml"
QUIET = ["trainer.plots=false", "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.save_every=0",
         "trainer.val_before_train=false", "trainer.export_hf=false"]
# A chat template whose assistant turns sit in {% generation %} blocks: transformers' assistant mask is the reference.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} {{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }} {{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = ["hello", "world", "how", "are", "you", "be", "brief", "3+4=", "7", "yes", "no"]
SGD = OptimConfig(name="sgd", lr=0.5, grad_clip=0.0)


def write_tokenizer(directory: pathlib.Path, template: str | None = TEMPLATE) -> pathlib.Path:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def chats(count: int, seed: int) -> list[dict]:
    """Chats of one to three exchanges (a system turn now and then) and prompt/completion rows, of random lengths."""
    rng = np.random.default_rng(seed)
    words = lambda: " ".join(rng.choice(WORDS, rng.integers(1, 5)))  # noqa: E731
    rows = []
    for i in range(count):
        if i % 4 == 3:
            rows.append({"prompt": words(), "completion": words()})
            continue
        messages = [{"role": "system", "content": words()}] if i % 3 == 0 else []
        for _ in range(rng.integers(1, 4)):
            messages += [{"role": "user", "content": words()}, {"role": "assistant", "content": words()}]
        rows.append({"messages": messages})
    return rows


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("sft_tokenizer"))


def sft_section(**kw):
    cfg = load_config(CONFIG, [f"sft.{k}={v}" for k, v in kw.items()])
    return cfg.sft, cfg.data


def test_chat_rows_mask_what_transformers_marks_as_the_assistant_s(tokenizer_dir):
    import transformers

    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tok = HFTokenizer.from_dir(tokenizer_dir)
    sft, data = sft_section()
    for number, row in enumerate(r for r in chats(12, 0) if "messages" in r):
        ours = tokenize_row(row, f"row {number}", sft, data, tok, {"sft.max_length": 200})
        out = reference.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert list(ours.prompt + ours.response) == list(out["input_ids"])
        assert [False] * len(ours.prompt) + list(ours.mask) == [bool(m) for m in out["assistant_masks"]]
        turns = sum(m["role"] == "assistant" for m in row["messages"])
        assert (not all(ours.mask)) == (turns > 1)  # the user turns between assistant turns are holes in the mask



def test_a_batch_lays_each_row_out_whole_within_the_longest_row():
    # 14 + 2 and 2 + 14 tokens: a prompt region as wide as the longest prompt and a response region as wide as the
    # longest completion would make both rows 28 tokens wide, for 16-token rows (sft.max_length=16)
    rows = [SFTRow(tuple(range(1, 15)), (20, 21), (True, True)),
            SFTRow((1, 2), tuple(range(30, 44)), (False,) * 4 + (True,) * 10)]
    batch = SFTData(rows, pad_id=0).experience([0, 1], pad_rows=1)
    assert batch.prompt_ids.shape[1] + batch.response_ids.shape[1] == 16
    for i, row in enumerate(rows):
        attended = np.concatenate([batch.prompt_ids[i][batch.prompt_mask[i]],
                                   batch.response_ids[i][batch.response_attention[i]]])
        assert attended.tolist() == [*row.prompt, *row.response]  # the whole row, in order, nothing else
        loss = batch.response_ids[i][batch.response_mask[i]].tolist()
        assert loss == [t for t, m in zip(row.response, row.mask) if m]  # the completion's marked tokens only
    assert not batch.response_attention[2].any() and not batch.response_mask[2].any()  # the padding row

def test_prompt_completion_rows_are_the_trainer_s_prompt_then_completion_and_eos_from_jsonl_or_parquet(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [{"prompt": "305=", "completion": "503"}, {"prompt": "1234=", "completion": "4321"}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), str(tmp_path / "rows.parquet"))
    cfg = load_config(CONFIG, [f"sft.train_files={jsonl(tmp_path / 'rows.jsonl', rows)}", "trainer.val_every=0",
                               "trainer.val_before_train=false"])
    inputs = sft_run.load_inputs(cfg)
    tok, first = inputs.tokenizer, inputs.train.rows[0]
    assert first.prompt == (tok.bos_id, *tok.encode("305="))
    assert first.response == (*tok.encode("503"), tok.eos_id) and all(first.mask)
    parquet = load_sft_data(dataclasses.replace(cfg.sft, train_files=str(tmp_path / "rows.parquet")), cfg.data, tok,
                            "train", {})
    assert parquet.rows == inputs.train.rows and inputs.val is None


# --- the contract: the update does not depend on K, token budgets, padding or the mesh ---------------------------

def sft_batch(tokenizer_dir, pad_rows=0, wider=0):
    tok = HFTokenizer.from_dir(tokenizer_dir)
    sft, data = sft_section()
    rows = [tokenize_row(r, f"row {i}", sft, data, tok, {}) for i, r in enumerate(chats(12, 1))]
    batch = SFTData(rows, tok.pad_id).experience(np.arange(12), pad_rows=pad_rows)
    if wider:  # more padding columns on both sides: left of the prompts, right of the responses
        left = lambda a, v: np.pad(a, ((0, 0), (wider, 0)), constant_values=v)  # noqa: E731
        right = lambda a, v: np.pad(a, ((0, 0), (0, wider)), constant_values=v)  # noqa: E731
        batch = dataclasses.replace(
            batch, prompt_ids=left(batch.prompt_ids, 0), prompt_mask=left(batch.prompt_mask, False),
            response_ids=right(batch.response_ids, 0), response_mask=right(batch.response_mask, False),
            response_attention=right(batch.response_attention, False))
    return batch


def reference_gradient(batch, mode):
    """``jax.grad`` of the whole batch's loss, written out: the token mean of ``-log p`` over every loss token, or
    the mean over rows with loss tokens of each row's token mean."""
    model = create_model(CausalLM, tiny_config("float32"), None, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    ids, positions, segments = padded_inputs(batch)
    p, length = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    mask = jnp.asarray(batch.response_mask)

    def loss(params):
        logits = nnx.merge(graphdef, params)(ids, positions, segments)[:, p - 1 : p - 1 + length]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, p:, None], -1)[..., 0]
        nll = jnp.where(mask, nll, 0.0)
        if mode == "token-mean":
            return nll.sum() / mask.sum()
        per_row, counts = nll.sum(1), mask.sum(1)
        return jnp.sum(jnp.where(counts > 0, per_row / jnp.maximum(counts, 1), 0)) / jnp.sum(counts > 0)

    return jax.value_and_grad(loss)(params)


def engine_gradient(batch, mesh, mode, **cut):
    model = create_model(CausalLM, tiny_config("float32"), mesh, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    cfg = ActorConfig(ppo_mini_batch_size=batch.num_sequences, shuffle=False, optim=SGD, loss_agg_mode=mode,
                      loss_scale_factor=16.0, **cut)
    state = init_train_state(params, cfg, mesh, keep_gradient=True)
    step = UpdateStep(graphdef, sft_loss_fn(cfg), cfg, mesh, "sft", keep_gradient=True)
    _, metrics, gradients = run_updates(step, state, batch, cfg, mesh, np.random.default_rng(0))
    return metrics, jax.tree.map(lambda g: np.asarray(g[0]), jax.device_get(gradients))


# (mesh, rows padded, columns padded, cut): K = 3 uneven micro-batches of 4 ragged rows; a token
# budget's packed rows (uneven K); four data shards; padding rows and columns with K = 2; the weights split over
# fsdp and tensor, the packed rows' tokens over sequence (context parallelism)
CASES = {
    "K3": ((1, 1, 1), 0, 0, dict(ppo_micro_batch_size=4)),
    "budget": ((1, 1, 1), 0, 0, dict(use_dynamic_bsz=True, ppo_max_token_len=40)),
    "budget-data4": ((4, 1, 1), 0, 0, dict(use_dynamic_bsz=True, ppo_max_token_len=40)),
    "padded-K2": ((1, 1, 1), 4, 3, dict(ppo_micro_batch_size=8)),
    "budget-fsdp2-tensor2-sequence2": ((1, 2, 2, 2), 0, 0, dict(use_dynamic_bsz=True, ppo_max_token_len=40)),
}


@pytest.mark.parametrize("mode,case", [*[("token-mean", c) for c in CASES], ("seq-mean-token-mean", "budget-data4")])
def test_the_sft_gradient_is_the_whole_batch_gradient_whatever_the_cut(tokenizer_dir, mode, case):
    mesh_shape, pad_rows, wider, cut = CASES[case]
    reference_loss, reference = reference_gradient(sft_batch(tokenizer_dir), mode)
    metrics, gradient = engine_gradient(sft_batch(tokenizer_dir, pad_rows, wider), mesh_of(mesh_shape), mode, **cut)
    chex.assert_trees_all_close(gradient, jax.device_get(reference), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["sft/loss"], float(reference_loss), rtol=1e-5)


# --- whole runs: the mesh, resume, bad input, SFT -> RL ------------------------------------------------------------

def sft_metrics(out: pathlib.Path, devices: int, *overrides: str) -> list[dict]:
    cfg = load_config(CONFIG, [*QUIET, f"trainer.output_dir={out}", "mesh.data=-1", *overrides])
    sft_run.run(cfg, sft_run.mesh_shape(cfg, devices), sft_run.load_inputs(cfg), devices=jax.devices()[:devices])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def test_two_sft_steps_log_the_same_metrics_on_one_and_four_devices_and_resume_exactly(tmp_path):
    two = ["trainer.total_steps=2", "trainer.val_every=2", "data.num_val_examples=32"]
    one_device = sft_metrics(tmp_path / "one", 1, *two)
    four = sft_metrics(tmp_path / "four", 4, *two)
    assert [sorted(r) for r in one_device] == [sorted(r) for r in four]
    assert {"sft/loss", "sft/nll", "sft/perplexity", "sft/grad_norm", "val/sft_nll", "val/sft_perplexity",
            "val/reward/mean", "val/accuracy"} <= set(one_device[-1])
    for a, b in zip(one_device, four):
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
    # stopped after one step, then resumed: step 2 as in the uninterrupted run (same mesh: bit for bit)
    sft_metrics(tmp_path / "resumed", 1, *two[1:], "trainer.total_steps=1")
    resumed = sft_metrics(tmp_path / "resumed", 1, *two)
    assert resumed[-1] == one_device[-1]


def test_the_held_out_greedy_score_of_an_sft_run_is_the_rl_evaluation_of_its_policy(tmp_path):
    """Rows that are the task's demonstrations: the SFT run's validation samples the task's held-out prompts
    greedily and scores them as the RL run does; ``python -m jppo.eval`` of the GRPO quickstart on the exported
    policy gets the same score, and the run plots it beside its loss."""
    from jppo import eval as eval_command

    rows = sft_metrics(tmp_path / "sft", 1, "trainer.total_steps=5", "trainer.val_every=5",
                       "data.num_val_examples=16", "trainer.export_hf=true", "trainer.plots=true")
    assert [r["step"] for r in rows if "val/reward/mean" in r] == [5] and "val/reward/mean" not in rows[0]
    score = rows[-1]["val/reward/mean"]
    assert 0.0 < score < 1.0, score  # five steps: partly reversed answers, so the equality below means something
    assert eval_command.main(["--config", str(ROOT / "configs" / "quickstart_grpo.yaml"),
                              f"model.path={tmp_path / 'sft' / 'hf'}", "data.num_val_examples=16",
                              f"trainer.output_dir={tmp_path / 'eval'}", "trainer.resume=never"]) == 0
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())["metrics"]
    assert evaluated["val/reward/mean"] == score and evaluated["val/accuracy"] == rows[-1]["val/accuracy"]
    assert {"sft.png", "validation.png"} <= {p.name for p in (tmp_path / "sft" / "plots").iterdir()}


def run_cli(argv, capsys, monkeypatch) -> str:
    monkeypatch.setattr(sft_run, "run", lambda *a, **k: pytest.fail("reached the run: nothing may compile"))
    assert sft_command.main(["--config", str(CONFIG), *QUIET, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or not err[-1].startswith(" "), err  # one line of our own, no traceback
    return err[-1]


def test_the_sft_command_logs_the_xla_environment_it_started_with(monkeypatch, caplog):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    monkeypatch.setattr(sft_run, "run", lambda *a, **k: {})  # what the command does before the run is the point
    with caplog.at_level("INFO", logger="jppo.sft"):
        assert sft_command.main(["--config", str(CONFIG), *QUIET, "trainer.compilation_cache=off"]) == 0
    logged = [record.getMessage() for record in caplog.records if record.name == "jppo.sft"]
    assert logged[:2] == ["compilation cache: off", "XLA_FLAGS=--xla_cpu_enable_fast_math=false"]
    assert "LIBTPU_INIT_ARGS=(unset)" in logged


def test_each_command_refuses_the_other_kind_of_run_s_keys_in_one_line(capsys, monkeypatch):
    """An RL key in an SFT command line, and an SFT config given to ``jppo.train``: one line naming the key and
    the value, exit status 2, before anything compiles."""
    from jppo import train

    assert run_cli(["algorithm.adv_estimator=grpo"], capsys, monkeypatch) == (
        "jppo.sft: error: algorithm.adv_estimator='grpo' is read by RL runs only (python -m jppo.train); python -m "
        "jppo.sft does not read it: remove it")
    monkeypatch.setattr(train, "run", lambda *a, **k: pytest.fail("reached the run: nothing may compile"))
    assert train.main(["--config", str(CONFIG), *QUIET]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jppo.train: error: sft.max_length=16 is read by python -m jppo.sft only, and this config is checked as an RL "
        "run's: run it with python -m jppo.sft, or remove it"]


def jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_bad_rows_are_refused_in_one_line_naming_the_file_the_row_and_the_key(tmp_path, capsys, monkeypatch,
                                                                              tokenizer_dir):
    ok = {"prompt": "12=", "completion": "21"}
    long = jsonl(tmp_path / "long.jsonl", [ok, {"prompt": "12=", "completion": "1234567890123456"}])
    assert run_cli([f"sft.train_files={long}"], capsys, monkeypatch) == (
        f"jppo.sft: error: {long} line 2 has 21 tokens > sft.max_length=16: raise sft.max_length or shorten the row")
    longer = jsonl(tmp_path / "longer.jsonl", [{"prompt": "12=", "completion": "1" * 50}])
    assert run_cli([f"sft.train_files={longer}", "sft.max_length=64", "actor.use_dynamic_bsz=true",
                    "actor.ppo_max_token_len=48"], capsys, monkeypatch) == (
        f"jppo.sft: error: {longer} line 1 has 55 tokens > actor.ppo_max_token_len=48: raise "
        "actor.ppo_max_token_len or shorten the row")
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]
    empty = jsonl(tmp_path / "empty.jsonl", [{"messages": chat}, {"messages": [chat[0], {"role": "assistant",
                                                                                          "content": " "}]}])
    assert run_cli([f"sft.train_files={empty}", f"model.tokenizer={tokenizer_dir}"], capsys, monkeypatch) == (
        f"jppo.sft: error: {empty} line 2: messages[1] is an assistant turn with empty content")
    chats_file = jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    no_template = write_tokenizer(tmp_path / "plain", template=None)
    assert run_cli([f"sft.train_files={chats_file}", f"model.tokenizer={no_template}"], capsys, monkeypatch) == (
        f"jppo.sft: error: {chats_file} line 1: 'messages' (sft.messages_key) needs a chat template, and tokenizer "
        f"'{no_template}' has none (no chat_template in tokenizer_config.json, no chat_template.jinja)")
    fields = jsonl(tmp_path / "fields.jsonl", [ok, {"question": "12=", "completion": "21"}])
    assert run_cli([f"sft.train_files={fields}"], capsys, monkeypatch) == (
        f"jppo.sft: error: {fields} line 2 has no key 'prompt' (sft.prompt_key), nor chat messages 'messages' "
        "(sft.messages_key); its keys are ['completion', 'question']")
    assert run_cli(["mesh.tensor=4", "model.num_heads=2"], capsys, monkeypatch) == (
        "jppo.sft: error: mesh.tensor=4 must divide the actor model's num_heads=2 and num_kv_heads=2: use a "
        "mesh.tensor dividing both, mesh.fsdp for the rest")
    renamed = run_cli([f"sft.train_files={fields}", "sft.completion_key=answer"], capsys, monkeypatch)
    assert renamed.endswith("line 1 has no key 'answer' (sft.completion_key), nor chat messages 'messages' "
                            "(sft.messages_key); its keys are ['completion', 'prompt']")


def test_a_one_step_lora_sft_run_starts_an_rl_run(tmp_path):
    from jppo.config import check_mesh
    from jppo.run import build
    from jppo.run.loop import run as rl_run

    # with LoRA adapters, merged into the exported weights (the full fine-tune's export: the docs' quickstart lines)
    sft_metrics(tmp_path / "sft", 1, "trainer.total_steps=1", "trainer.val_every=0", "trainer.export_hf=true",
                "actor.lora.rank=4", "actor.lora.alpha=8")
    exported = tmp_path / "sft" / "hf"
    cfg = load_config(ROOT / "configs" / "quickstart_grpo.yaml", [
        f"model.path={exported}", "trainer.total_steps=1", "trainer.val_every=0", f"trainer.output_dir={tmp_path}/rl",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "rollout.n=2",
        *QUIET])
    inputs = build.load_inputs(cfg)
    metrics = rl_run(cfg, check_mesh(cfg, 1), inputs, devices=jax.devices()[:1])
    assert np.isfinite(metrics["actor/pg_loss"]) and 0 <= metrics["reward/mean"] <= 1
    record = json.loads((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1


def test_a_lora_sft_run_s_adapters_are_kept_into_rl_unmerged(tmp_path, capsys, monkeypatch):
    """``python -m jppo.export --keep-adapters`` of a LoRA SFT run writes its base and, beside it, its adapters; an
    RL run from there (``model.path``, the same ``actor.lora``) trains those adapters on, unmerged: its trained
    parameters are the SFT run's adapters as they were, its policy's log-probs before the first update are the SFT
    policy's (float32: the same weights and program, so 1e-6), and it trains a step. Another ``actor.lora``, or
    none, is refused in one line before anything compiles."""
    from jppo import export as export_command
    from jppo import train
    from jppo.config import check_mesh
    from jppo.engine.forward import forward_batch, log_prob_fn
    from jppo.run import build
    from jppo.run import export as run_export
    from jppo.run.loop import run as rl_run

    lora = ["actor.lora.rank=4", "actor.lora.alpha=8"]
    sft_metrics(tmp_path / "sft", 1, "trainer.total_steps=3", "trainer.val_every=0", *lora)
    kept = tmp_path / "kept"
    assert export_command.main([str(tmp_path / "sft"), str(kept), "--keep-adapters"]) == 0
    assert {"config.json", "model.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in kept.iterdir()}
    checkpoint = run_export.find_checkpoint(tmp_path / "sft", None)
    sft_cfg = run_export.run_config(checkpoint)
    sft_inputs = sft_run.load_inputs(sft_cfg)
    sft_policy = run_export.restore_policy(checkpoint, sft_cfg, sft_inputs.tokenizer)  # adapters unmerged

    rl = [f"model.path={kept}", "trainer.total_steps=1", "trainer.val_every=0", f"trainer.output_dir={tmp_path}/rl",
          "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "rollout.n=2",
          *QUIET]
    cfg = load_config(ROOT / "configs" / "quickstart_grpo.yaml", [*rl, *lora])
    inputs = build.load_inputs(cfg)
    mesh = mesh_of((1, 1, 1))
    models = build.models(cfg, inputs.tokenizer, mesh)
    saved = nnx.state(sft_policy, nnx.LoRAParam)
    chex.assert_trees_all_equal(jax.device_get(models.actor.params), jax.device_get(saved))
    rows = sft_inputs.train.experience(np.arange(8))
    weights = nnx.merge_state(models.actor.frozen, models.actor.params)
    rl_log_probs = forward_batch(log_prob_fn(models.actor.graphdef, temperature=1.0, chunk_size=256), weights, rows,
                                 mesh, micro_batch_size=8)
    graphdef, sft_weights = nnx.split(sft_policy, nnx.Param, ...)[:2]
    sft_log_probs = forward_batch(log_prob_fn(graphdef, temperature=1.0, chunk_size=256), sft_weights, rows, mesh,
                                  micro_batch_size=8)
    np.testing.assert_allclose(rl_log_probs, sft_log_probs, rtol=1e-6, atol=1e-6)
    assert np.abs(rl_log_probs).max() > 0
    metrics = rl_run(cfg, check_mesh(cfg, 1), inputs, devices=jax.devices()[:1])
    assert np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0

    monkeypatch.setattr(train, "run", lambda *a, **k: pytest.fail("reached the run: nothing may compile"))
    grpo = ["--config", str(ROOT / "configs" / "quickstart_grpo.yaml"), *rl]
    assert train.main([*grpo, "actor.lora.rank=8", "actor.lora.alpha=8"]) == 2
    assert train.main(grpo) == 2
    refusals = capsys.readouterr().err.strip().splitlines()
    assert refusals[-2].startswith("jppo.train: error: actor.lora (rank=8, alpha=8.0, targets ") and (
        f"differs from the adapters model.path='{kept}' holds (r=4, lora_alpha=8.0" in refusals[-2])
    assert refusals[-1] == (
        f"jppo.train: error: model.path='{kept}' holds LoRA adapters (adapter_config.json: r=4, lora_alpha=8.0): set "
        "actor.lora.rank=4 actor.lora.alpha=8.0 actor.lora.target_modules=['down_proj', 'gate_proj', 'k_proj', "
        "'o_proj', 'q_proj', 'up_proj', 'v_proj'] to keep training them, or start from the run's merged export "
        "(python -m jppo.export RUN OUT)")


def test_the_audit_takes_an_sft_config(capsys):
    """``jppo.audit --sft``: the SFT update of the quickstart config, on two data shards with the finest cuts,
    against one device and one micro-batch."""
    from jppo import audit

    status = audit.main(["--config", str(CONFIG), "--sft", "--meshes", "2x1x1x1", "sft.batch_size=8",
                         "actor.ppo_micro_batch_size=2"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "jppo.audit: one SFT step of 8 rows" in out and "compared (sft): sft/grad_norm, sft/loss" in out
    rows = [line for line in out.splitlines() if line.startswith("sft ")]
    assert len(rows) == 2 and "(2, 1, 1, 1)   fixed micro=1" in rows[0] and "tokens<=13" in rows[1], rows
