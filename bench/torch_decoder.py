"""The PyTorch peer of jppo's decoder for the update-step benchmark: the same architecture, eager mode.

Pre-norm layers ``h += o(attn(rope(q(n1 h)), rope(k(n1 h)), v(n1 h)))``, ``h += down(silu(gate(n2 h)) * up(n2 h))``
with RMSNorm, rotate-half RoPE (``f_i = theta^(-2i/E)``), grouped-query attention (query head ``h`` reads key head
``h // (H/K)``), q/k/v biases as the family has them (Qwen2), q/k RMSNorm for Qwen3, and a tied or untied LM head,
as :class:`jppo.models.ModelConfig` describes. Written the way a PyTorch user would: ``nn.Linear`` layers (weights
``[out, in]``), ``F.rms_norm`` and ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``. Rows are
unpadded (every sequence fills the row), which is what the benchmark feeds both implementations.

:meth:`TorchCausalLM.from_jppo` copies a jppo model's parameters, so both start from the same weights and their
first losses can be compared. :class:`TorchActorUpdate` is one PPO actor optimizer step: forward, the clipped
(dual-clip) policy loss as a masked token mean, backward, global-norm clipping, AdamW.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jppo.core.experience import Experience
from jppo.engine import ActorConfig
from jppo.models import ModelConfig


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``(a, b) -> (a cos - b sin, b cos + a sin)`` on the halves of ``x [B, heads, T, E]``."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class TorchDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        width, mlp = cfg.hidden_size, cfg.intermediate_size
        self.cfg = cfg
        self.input_norm = nn.Parameter(torch.ones(width))
        self.q_proj = nn.Linear(width, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(width, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(width, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, width, bias=cfg.attention_out_bias)
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.post_attention_norm = nn.Parameter(torch.ones(width))
        self.gate_proj = nn.Linear(width, mlp, bias=False)
        self.up_proj = nn.Linear(width, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, width, bias=False)

    def _heads(self, x: torch.Tensor, heads: int, norm: nn.Parameter | None) -> torch.Tensor:
        batch, length, _ = x.shape
        x = x.view(batch, length, heads, self.cfg.head_dim)
        if norm is not None:
            x = F.rms_norm(x, (self.cfg.head_dim,), norm, self.cfg.rms_norm_eps)
        return x.transpose(1, 2)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        batch, length, width = hidden.shape
        x = F.rms_norm(hidden, (width,), self.input_norm, cfg.rms_norm_eps)
        q = _rotate(self._heads(self.q_proj(x), cfg.num_heads, self.q_norm), cos, sin)
        k = _rotate(self._heads(self.k_proj(x), cfg.num_kv_heads, self.k_norm), cos, sin)
        v = self._heads(self.v_proj(x), cfg.num_kv_heads, None)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        hidden = hidden + self.o_proj(attended.transpose(1, 2).reshape(batch, length, cfg.q_size))
        x = F.rms_norm(hidden, (width,), self.post_attention_norm, cfg.rms_norm_eps)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TorchCausalLM(nn.Module):
    """``input_ids [B, T] -> logits [B, T, V]`` (float32), one unpadded sequence per row."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.rope_scaling is not None or cfg.param_dtype != "float32" or cfg.dtype != "float32":
            raise ValueError("TorchCausalLM implements float32 models with plain RoPE only (no rope_scaling)")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TorchDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inverse = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        self.register_buffer("inverse_frequencies", inverse.float(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(input_ids.shape[1], device=input_ids.device)[:, None] * self.inverse_frequencies
        cos, sin = angles.cos(), angles.sin()
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        hidden = F.rms_norm(hidden, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        return hidden @ self.embed_tokens.weight.T if self.lm_head is None else self.lm_head(hidden)

    @classmethod
    def from_jppo(cls, cfg: ModelConfig, params: Mapping) -> TorchCausalLM:
        """A model holding the parameters of a jppo ``CausalLM`` (``nnx.to_pure_dict`` of its ``nnx.Param`` state;
        jppo kernels are ``[in, out]`` and stacked over layers)."""
        model = cls(cfg)
        decoder, stacked = params["decoder"], params["decoder"]["layers"]
        copies = {"embed_tokens.weight": decoder["embed_tokens"], "norm": decoder["norm"]}
        if model.lm_head is not None:
            copies["lm_head.weight"] = np.asarray(params["lm_head"]).T
        for index in range(cfg.num_layers):
            for name, value in stacked.items():
                kernel = name.endswith("_proj")
                target = f"{name}.weight" if kernel else name.replace("_bias", "_proj.bias")
                copies[f"layers.{index}.{target}"] = np.asarray(value[index]).T if kernel else value[index]
        own = model.state_dict()
        missing = sorted(set(own) - set(copies))
        if missing:
            raise KeyError(f"jppo parameters do not cover torch parameters {missing}")
        model.load_state_dict({name: torch.tensor(np.asarray(value)) for name, value in copies.items()})
        return model


class TorchActorUpdate:
    """One PPO actor optimizer step in PyTorch on an unpadded ``batch``, mirroring jppo's vanilla policy loss:

        ratio = exp(logp - old),  l = max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)),
        l = min(l, -A c) where A < 0 (dual clip),  loss = sum(mask * l) / sum(mask),

    then global-norm clipping of the gradient and AdamW with jppo's optimizer settings.
    """

    def __init__(self, model: TorchCausalLM, batch: Experience, cfg: ActorConfig, device: str = "cpu"):
        if not (batch.prompt_mask.all() and batch.response_attention.all()):
            raise ValueError("TorchActorUpdate needs an unpadded batch (every prompt and response fills its row)")
        as_tensor = lambda array, dtype: torch.as_tensor(np.asarray(array), dtype=dtype, device=device)  # noqa: E731
        self.model = model.to(device)
        self.prompt_length = batch.prompt_ids.shape[1]
        self.input_ids = as_tensor(np.concatenate([batch.prompt_ids, batch.response_ids], axis=1), torch.long)
        self.targets = as_tensor(batch.response_ids, torch.long)
        self.mask = as_tensor(batch.response_mask, torch.bool)
        self.old_log_prob = as_tensor(batch.old_log_prob, torch.float32)
        self.advantages = as_tensor(batch.advantages, torch.float32)
        self.cfg = cfg
        optim = cfg.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.device = device

    def loss(self) -> torch.Tensor:
        logits = self.model(self.input_ids)[:, self.prompt_length - 1 : -1]
        log_prob = torch.log_softmax(logits.float(), dim=-1).gather(-1, self.targets[..., None])[..., 0]
        advantages, eps = self.advantages, self.cfg.clip_ratio
        ratio = torch.exp(log_prob - self.old_log_prob)
        clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps))
        per_token = torch.where(advantages < 0, torch.minimum(clipped, -advantages * self.cfg.clip_ratio_c), clipped)
        return torch.where(self.mask, per_token, 0.0).sum() / self.mask.sum()

    def __call__(self) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        return {"pg_loss": float(loss.detach())}  # float() waits for the device, as jppo's step does
