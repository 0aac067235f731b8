"""Qwen2 (Qwen2.5-Coder): the Llama layer with a bias on the Q, K and V projections.

The bias is switched on by `ModelConfig.qkv_bias`, so the layer itself is Llama's."""

from __future__ import annotations

from .llama import LlamaDecoderLayer
from .transformer import DecoderModel


class Qwen2ForCausalLM(DecoderModel):
    layer_class = LlamaDecoderLayer
