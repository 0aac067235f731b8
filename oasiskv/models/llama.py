"""Llama (SmolLM2): pre-norm attention and pre-norm gated-SiLU MLP."""

from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, SelfAttention
from .transformer import DecoderModel


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention(config, layer)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, backend):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(DecoderModel):
    layer_class = LlamaDecoderLayer
