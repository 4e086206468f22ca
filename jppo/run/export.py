"""A trained policy as a Hugging Face directory (``python -m jppo.export RUN_DIR_OR_CHECKPOINT OUT_DIR [--dtype D]
[--max-shard-size 2GB] [--step N]``) that ``AutoModelForCausalLM``, ``AutoTokenizer`` and ``vllm serve`` read as is.

The input is a run directory (its newest complete checkpoint, or ``--step N``) or one checkpoint directory
(``RUN/checkpoints/<step>``); the run's ``config.yaml`` says where the model and the tokenizer came from. Only the
actor's parameters are read from the checkpoint, onto the CPU (no optimizer is built, no moment is read).

``OUT_DIR`` receives:

- ``config.json`` and the weights in ``--dtype`` (default: the source model's dtype, i.e. ``config.json``'s
  ``dtype``/``torch_dtype`` of ``model.path``, or ``model.param_dtype`` for a model trained from scratch): one
  ``model.safetensors``, or shards of at most ``--max-shard-size`` plus ``model.safetensors.index.json``;
- ``generation_config.json``: the source's, with ``bos_token_id``, ``pad_token_id`` and every EOS id of the
  tokenizer as the list ``eos_token_id`` (chat models end a turn with one token and a text with another);
- the tokenizer: the source's tokenizer files copied, or, for a built-in character vocabulary, an equivalent
  ``tokenizer.json`` that encodes and decodes the same ids.

With ``--keep-adapters`` (a LoRA run) ``OUT_DIR`` holds the base model the adapters were trained on and, beside it,
the adapters in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``, float32): given as
``model.path`` with the same ``actor.lora``, an RL run trains the same adapters on, unmerged.

Everything is written into a temporary sibling directory that is renamed to ``OUT_DIR`` once complete, so a
reader never sees half an export. ``OUT_DIR`` may be a ``gs://`` URI (written through ``etils.epath``); an object
store has no directory rename, so there the files are written in place (see :func:`write_atomically`). The trainer's
end-of-run export (``trainer.export_hf``) calls :func:`export_policy` too. Errors are one line, exit status 2.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import tempfile
from typing import Callable, Optional

import jax
from etils import epath
from flax import nnx

from jppo.config import TrainConfig, load_config, views
from jppo.core.paths import is_remote, run_path
from jppo.data import CharTokenizer, Tokenizer
from jppo.models import CausalLM, ModelConfig, read_config, save_pretrained
from jppo.models.config import DTYPES
from jppo.models.lora import base_model, merged, save_peft_adapter
from jppo.run import build
from jppo.run.checkpoint import SFT_META, committed_steps, fingerprint, read_meta, restore_part
from jppo.run.record import check_base_checksums, checkpoint_models, model_record

DEFAULT_MAX_SHARD_SIZE = "2GB"
# transformers' spelling of sizes: decimal KB/MB/GB, binary KiB/MiB/GiB
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# what a Hugging Face tokenizer directory may hold besides the weights (copied when present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
EXPORT_DTYPES = ("bfloat16", "float32", "float16")


class ExportError(ValueError):
    """An input the export cannot use: a missing run, checkpoint or step, a bad size."""


def parse_size(text: str) -> int:
    """Bytes of a size such as ``2GB`` (10^9 B), ``500MiB`` (2^20 B each) or ``1000000``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise ExportError(f"--max-shard-size={text!r} is not a positive size such as 2GB, 500MB or 1GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def find_checkpoint(source: epath.Path, step: Optional[int] = None) -> epath.Path:
    """The checkpoint directory ``source`` names: a run directory's newest committed step (or ``step``), or
    ``source`` itself when it is a checkpoint directory."""
    if (source / "checkpoints").is_dir():
        steps = committed_steps(source / "checkpoints")
        if not steps:
            raise ExportError(f"run directory {str(source)!r} has no complete checkpoint in checkpoints/")
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise ExportError(f"--step={step}: no complete checkpoint {step} in {str(source)!r}; steps: {steps}")
        return source / "checkpoints" / str(step)
    if (source / "state").is_dir():
        if step is not None:
            raise ExportError(f"--step={step} picks a checkpoint of a run directory; {str(source)!r} is one checkpoint")
        return source
    raise ExportError(
        f"{str(source)!r} is neither a run directory (with checkpoints/) nor a checkpoint directory (with state/)"
    )


def run_config(checkpoint: epath.Path) -> TrainConfig:
    """The configuration of the run that wrote ``checkpoint`` (``RUN/checkpoints/<step>``): ``RUN/config.yaml``,
    checked as an SFT config when ``python -m jppo.sft`` wrote the checkpoint."""
    path = run_path(checkpoint).parent.parent / "config.yaml"
    if not path.is_file():
        raise ExportError(f"no config.yaml of the run next to checkpoints/ (looked for {str(path)!r})")
    return load_config(path, sft=True if read_meta(checkpoint).get(SFT_META) else None)


def source_dtype(cfg: TrainConfig) -> str:
    """The dtype the policy came in: its checkpoint's ``config.json`` (``dtype``, or ``torch_dtype`` before
    transformers 5; float32 when absent, as transformers assumes), else ``model.param_dtype``."""
    if not cfg.model.path:
        return cfg.model.param_dtype
    hf = json.loads((pathlib.Path(cfg.model.path) / "config.json").read_text())
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"


def policy_config(cfg: TrainConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The policy's architecture, as the trainer built it (``jppo.run.build.build_policy``)."""
    if cfg.model.path:
        return read_config(cfg.model.path, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    return views.random_model_config(cfg, tokenizer)


def restore_policy(checkpoint: epath.Path, cfg: TrainConfig, tokenizer: Tokenizer) -> CausalLM:
    """The actor of ``checkpoint`` as a :class:`CausalLM` on the first CPU device: only ``actor.params`` is read.
    With ``actor.lora`` those are the adapters: the base weights are rebuilt as the checkpoint records them
    (``model.path``, or the seed it was drawn from, whatever ``trainer.seed`` the run's config says now) and the
    adapters attached to them; a config that would build another base is refused in one line."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    if cfg.actor.lora.enabled:
        source = f"checkpoint {str(checkpoint)!r}"
        seed, saved = checkpoint_models(cfg, read_meta(checkpoint), source)
        with jax.default_device(jax.devices("cpu")[0]):
            actor = build.models(cfg, tokenizer, None, seed, roles=("actor",), reference=False).actor
        graphdef, abstract, frozen = actor.graphdef, actor.params, actor.frozen
        if saved is not None:
            checksums = {"actor": fingerprint(frozen)} if cfg.model.path else {}
            check_base_checksums(saved, model_record(cfg, seed, checksums), source, roles=("actor",))
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), abstract)
        return nnx.merge(graphdef, frozen, _restore_actor_params(checkpoint, abstract, cpu))
    abstract_model = nnx.eval_shape(lambda: CausalLM(policy_config(cfg, tokenizer), rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(abstract_model, nnx.Param)
    return nnx.merge(graphdef, _restore_actor_params(checkpoint, abstract, cpu))


def _restore_actor_params(checkpoint: epath.Path, abstract: nnx.State, cpu) -> nnx.State:
    # orbax stores an nnx.Param as {"value": array}
    target = jax.tree.map(
        lambda leaf: {"value": jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=cpu)}, nnx.to_pure_dict(abstract)
    )
    restored = restore_part(checkpoint, {"actor": {"params": target}})["actor"]["params"]
    pure = jax.tree.map(
        lambda leaf: leaf["value"], restored, is_leaf=lambda node: isinstance(node, dict) and "value" in node
    )
    nnx.replace_by_pure_dict(abstract, pure)
    return abstract


def merged_policy(model: CausalLM) -> CausalLM:
    """The policy as plain weights: LoRA adapters merged into their kernels (``W + alpha / r A B``)."""
    return merged(model)


def base_policy(model: CausalLM) -> CausalLM:
    """The base weights a LoRA policy's adapters were trained on, without the adapters (``--base``)."""
    if model.decoder.layers.lora is None:
        raise ExportError("--base: the run trained no LoRA adapters (actor.lora.rank is 0): its policy is the model")
    return base_model(model)


def export_adapters(
    model: CausalLM, cfg: TrainConfig, out: str | os.PathLike, *, dtype: str = "float32", replace: bool = True
) -> list[str]:
    """The policy's LoRA adapters alone, as PEFT writes them: ``adapter_config.json`` and
    ``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained(<the base model>, out)``."""
    adapters = model.decoder.layers.lora
    if adapters is None:
        raise ExportError("--adapters: the run trained no LoRA adapters (actor.lora.rank is 0)")
    if dtype not in ("float32", "float16"):
        raise ExportError(f"--dtype={dtype!r}: adapters are written as float32 or float16")
    return write_atomically(
        out, lambda directory: save_peft_adapter(adapters, cfg.actor.lora, directory, dtype=dtype,
                                                 base_model=cfg.model.path), replace,
    )


def generation_config(tokenizer: Tokenizer, config: ModelConfig, source: Optional[pathlib.Path]) -> dict:
    """``source/generation_config.json`` (if any) with the tokenizer's special ids: BOS (the model config's when
    the tokenizer has none), PAD, and every EOS id as a list."""
    gen = {}
    if source is not None and (source / "generation_config.json").is_file():
        gen = json.loads((source / "generation_config.json").read_text())
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else config.bos_token_id
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    gen["eos_token_id"] = [int(token) for token in tokenizer.eos_ids]
    gen["pad_token_id"] = int(tokenizer.pad_id)
    return gen


def write_tokenizer(tokenizer: Tokenizer, spec: str, directory: epath.Path) -> list[str]:
    """The tokenizer files: copied from the tokenizer directory ``spec``, or made for a built-in vocabulary."""
    if isinstance(tokenizer, CharTokenizer):
        files = tokenizer.hf_files()
        for name, text in files.items():
            (directory / name).write_text(text, encoding="utf-8")
        return list(files)
    copied = [name for name in TOKENIZER_FILES if (pathlib.Path(spec) / name).is_file()]
    for name in copied:  # read locally, written through epath (``directory`` may be a gs:// URI)
        (directory / name).write_bytes((pathlib.Path(spec) / name).read_bytes())
    return copied


def write_atomically(
    out: str | os.PathLike, write: Callable[[epath.Path], list[str]], replace: bool
) -> list[str]:
    """``write(tmp)`` into a new sibling of ``out``, then the rename of that directory to ``out`` (an existing
    ``out`` is replaced only when ``replace``, else it must be empty or absent).

    A ``gs://`` ``out`` is not atomic: an object store cannot rename a directory (a "rename" copies every object),
    so the files are written straight into ``out`` (after any existing ``out`` is deleted) and a reader may see a
    partial export until this returns; a failed export is deleted."""
    out = run_path(out)
    if out.exists() and not replace and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output directory {str(out)!r} exists and is not empty: choose another, or --overwrite")
    if is_remote(out):
        if out.exists():
            out.rmtree()
        tmp = out
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = epath.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = write(tmp)
        if tmp != out:
            os.chmod(tmp, 0o755)  # mkdtemp's directory is private to its owner; an export is for other tools too
            if out.exists():
                old = tmp.with_name(tmp.name + "-old")
                out.rename(old)
                tmp.rename(out)
                old.rmtree()
            else:
                tmp.rename(out)
        return files
    except BaseException:
        tmp.rmtree(missing_ok=True)
        raise


def export_policy(
    model: CausalLM, cfg: TrainConfig, tokenizer: Tokenizer, out: str | os.PathLike, *, dtype: Optional[str] = None,
    max_shard_bytes: Optional[int] = None, replace: bool = True,
    extra: Optional[Callable[[epath.Path], list[str]]] = None,
) -> list[str]:
    """Writes ``model`` (host arrays), its generation config and tokenizer into ``out`` atomically; returns the
    file names. ``dtype`` defaults to :func:`source_dtype`; ``max_shard_bytes`` to ``DEFAULT_MAX_SHARD_SIZE``;
    ``extra(directory)`` writes more files beside them."""
    dtype = dtype or source_dtype(cfg)
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype={dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    shard = max_shard_bytes if max_shard_bytes is not None else parse_size(DEFAULT_MAX_SHARD_SIZE)
    spec = views.tokenizer_spec(cfg)
    source = pathlib.Path(cfg.model.path) if cfg.model.path else None

    def write(directory: epath.Path) -> list[str]:
        files = save_pretrained(model, directory, dtype=dtype, max_shard_bytes=shard)
        gen = generation_config(tokenizer, model.config, source)
        (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        more = extra(directory) if extra is not None else []
        return [*files, "generation_config.json", *write_tokenizer(tokenizer, spec, directory), *more]

    return write_atomically(out, write, replace)


def export_kept(
    model: CausalLM, cfg: TrainConfig, tokenizer: Tokenizer, out: str | os.PathLike, *, dtype: Optional[str] = None,
    max_shard_bytes: Optional[int] = None, replace: bool = True,
) -> list[str]:
    """The base the LoRA adapters were trained on (:func:`base_policy`) and, beside its weights, the adapters in
    PEFT's layout, in float32: the directory an RL run's ``model.path`` starts from with the same ``actor.lora``,
    training the same adapters on, unmerged (:func:`jppo.run.build.models` loads them)."""
    adapters = model.decoder.layers.lora
    if adapters is None:
        raise ExportError("--keep-adapters: the run trained no LoRA adapters (actor.lora.rank is 0)")
    return export_policy(base_policy(model), cfg, tokenizer, out, dtype=dtype, max_shard_bytes=max_shard_bytes,
                         replace=replace,
                         extra=lambda directory: save_peft_adapter(adapters, cfg.actor.lora, directory))
