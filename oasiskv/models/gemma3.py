"""Gemma 3 (text): sandwich norms around attention and MLP, QK-norm, GELU-tanh MLP, embeddings
scaled by sqrt(hidden), and sliding-window layers with their own RoPE base (the window and the
bases are per-layer fields of ModelConfig, applied by the attention backend and the model)."""

from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, SelfAttention
from .transformer import DecoderModel


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)  # noqa: E731
        self.self_attn = SelfAttention(config, layer)
        self.mlp = GatedMLP(config)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, hidden, cos, sin, backend):
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, backend)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(DecoderModel):
    layer_class = Gemma3DecoderLayer
