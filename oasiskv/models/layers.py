"""Building blocks shared by the architectures: norms, RoPE, the gated MLP and the attention
projection block. Attention itself (where keys live, which keys a query sees) is delegated to an
`AttentionBackend`, so the same layer code runs dense paged decode and the decode node's sparse
working set."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. `offset` is 1 for Gemma, whose checkpoints store w - 1."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.weight.float() + self.offset)).to(x.dtype)


class RotaryEmbedding:
    """Non-interleaved (rotate-half) RoPE, the Hugging Face convention; cos/sin in fp32."""

    def __init__(self, head_dim: int, theta: float, scaling_factor: float = 1.0):
        # Built on the CPU explicitly: models are constructed under the meta device.
        steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        self.inv_freq = 1.0 / (theta**steps)
        self.scaling_factor = scaling_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        freqs = (positions.float() / self.scaling_factor)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim] fp32."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"activation {config.hidden_act!r} is not supported: {sorted(_ACTIVATIONS)}")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # In place: a prefill chunk's product is 19 MiB (Qwen 0.5B, 1,024 rows), and a fresh
        # tensor that size is page-faulted in every layer.
        hidden = self.act(gate)
        hidden *= up
        return self.down_proj(hidden)


class AttentionBackend(Protocol):
    """Where a layer's keys and values live and which of them each query row attends to.

    Called with post-RoPE projections of the flat token batch; returns [tokens, heads, head_dim].
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_weight_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_weight_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, backend: AttentionBackend) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
