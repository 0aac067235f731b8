"""The decoder-only transformer shared by every architecture: embeddings, a stack of layers, the
final norm and the LM head. An architecture file contributes only its decoder layer and the
mapping from Hugging Face parameter names to this module's (fused) parameters."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import AttentionBackend, RMSNorm, RotaryEmbedding


class DecoderModel(nn.Module):
    layer_class: type[nn.Module]  # set by each architecture

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Layers with the same RoPE parameters share one cos/sin computation per forward.
        self._rope_keys = [
            (config.rope_theta[i], (config.rope_scaling_factor or (1.0,) * config.num_layers)[i])
            for i in range(config.num_layers)
        ]
        self._ropes = {key: RotaryEmbedding(config.head_dim, *key) for key in set(self._rope_keys)}
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [tokens] (all sequences of the batch, flattened) -> hidden [tokens, H]."""
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:
            # Rounded to the weight dtype first, as the reference implementation does.
            hidden = hidden * torch.tensor(self.config.embedding_scale, dtype=hidden.dtype)
        rope = {key: r.cos_sin(positions) for key, r in self._ropes.items()}
        for layer, key in zip(self.layers, self._rope_keys):
            hidden = layer(hidden, *rope[key], backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- weights -------------------------------------------------------------------------
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint that uses Hugging Face parameter names (fusing QKV and gate/up)."""
        params = dict(self.named_parameters())
        fused: dict[str, list[torch.Tensor | None]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in state.items():
            name, part, parts = self.map_hf_name(hf_name)
            if name is None:
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            if parts == 1:
                self._copy(params[name], tensor, hf_name)
                loaded.add(name)
            else:
                fused.setdefault(name, [None] * parts)[part] = tensor
        for name, pieces in fused.items():
            if any(p is None for p in pieces):
                raise KeyError(f"checkpoint is missing part of fused parameter {name}")
            self._copy(params[name], torch.cat(pieces, dim=0), name)
            loaded.add(name)
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:5]}")

    @staticmethod
    def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        param.data.copy_(tensor)

    _FUSED = {
        "q_proj": ("qkv_proj", 0, 3),
        "k_proj": ("qkv_proj", 1, 3),
        "v_proj": ("qkv_proj", 2, 3),
        "gate_proj": ("gate_up_proj", 0, 2),
        "up_proj": ("gate_up_proj", 1, 2),
    }

    def map_hf_name(self, hf_name: str) -> tuple[str | None, int, int]:
        """HF name -> (our parameter name, part index, number of parts); None to skip."""
        name = hf_name.removeprefix("model.")
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.")
        if "rotary_emb" in name:
            return None, 0, 1
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None, 0, 1
        pieces = name.split(".")
        for i, piece in enumerate(pieces):
            if piece in self._FUSED:
                target, part, parts = self._FUSED[piece]
                pieces[i] = target
                return ".".join(pieces), part, parts
        return name, 0, 1
