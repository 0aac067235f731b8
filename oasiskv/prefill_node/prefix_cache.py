"""The prefill worker's prefix cache: the KV of recent prompts' full blocks, kept so that a prompt
that begins as an earlier one did (the next turn of a chat, the same document asked again, the
other choices of an n > 1 request) is prefilled from where they part, not from token 0.

Blocks are keyed by a chain of hashes, each over its parent's key and its own tokens, so one key
names a whole prefix, and prompts that share a beginning share its blocks. A hit does not trust
the hash: each block found must hold the prompt's own tokens and name as its parent the very
block found before it (by a serial number no other block ever gets), so the whole prefix is
checked token by token and a collision, even a crafted one, is a miss, never another prompt's
KV. Eviction is least recently used, block by block; a prompt's blocks are touched last block
first, so a prefix outlives the blocks that extend it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count

import torch

_ROOT_KEY = b""  # the parent key of every prompt's first block
_ROOT_SERIAL = 0


@dataclass
class _Block:
    serial: int  # never reused: a block that takes an evicted one's key is not its children's parent
    parent_serial: int
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, kv_heads, block_size, head_dim]
    values: torch.Tensor


@dataclass
class PrefixHit:
    """The cached beginning of a prompt: `tokens` tokens in whole blocks, first to last."""

    tokens: int
    blocks: list[_Block] = field(default_factory=list)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of the hit, [kv_heads, tokens, head_dim] each: a layer at a time,
        so a long hit is never copied whole a second time."""
        return (torch.cat([block.keys[layer] for block in self.blocks], dim=1),
                torch.cat([block.values[layer] for block in self.blocks], dim=1))


class PrefixCache:
    def __init__(self, capacity_bytes: int, block_size: int):
        if capacity_bytes < 0:
            raise ValueError(f"the prefix cache's capacity must be at least 0 bytes, got {capacity_bytes}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.capacity_bytes = int(capacity_bytes)
        self.block_size = block_size
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._serials = count(_ROOT_SERIAL + 1)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def _chain(self, prompt_ids: list[int], blocks: int) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, tokens) of the prompt's first `blocks` full blocks."""
        chain, parent, size = [], _ROOT_KEY, self.block_size
        for b in range(blocks):
            tokens = tuple(prompt_ids[b * size:(b + 1) * size])
            key = self._key(parent, tokens)
            chain.append((key, tokens))
            parent = key
        return chain

    @staticmethod
    def _key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
        return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()

    def _matched(self, chain) -> list[_Block]:
        found, parent_serial = [], _ROOT_SERIAL
        for key, tokens in chain:
            block = self._blocks.get(key)
            if block is None or block.parent_serial != parent_serial or block.tokens != tokens:
                break
            found.append(block)
            parent_serial = block.serial
        return found

    def _touch(self, chain, blocks: int) -> None:
        for key, _ in reversed(chain[:blocks]):
            self._blocks.move_to_end(key)

    def lookup(self, prompt_ids: list[int]) -> PrefixHit:
        """The longest cached beginning of `prompt_ids` in whole blocks, leaving at least its last
        token to compute (the first token is sampled from that row's logits)."""
        if not self.enabled or len(prompt_ids) < 2:
            return PrefixHit(0)
        chain = self._chain(prompt_ids, (len(prompt_ids) - 1) // self.block_size)
        found = self._matched(chain)
        if not found:
            return PrefixHit(0)
        self._touch(chain, len(found))
        return PrefixHit(len(found) * self.block_size, found)

    def insert(self, prompt_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Keep the KV of `prompt_ids`' full blocks; `keys[layer]` / `values[layer]` are
        [kv_heads, >= len(prompt_ids), head_dim], token i at index i. Returns the blocks added.
        Blocks already cached are only touched; older blocks are evicted to make room, and a
        prompt larger than the whole cache keeps only the beginning that fits."""
        if not self.enabled:
            return 0
        size = self.block_size
        chain = self._chain(prompt_ids, len(prompt_ids) // size)
        matched = self._matched(chain)
        have = len(matched)
        per_block = 2 * sum(k[:, :size].numel() * k.element_size() for k in keys)
        fits = min(len(chain), self.capacity_bytes // per_block) if per_block else 0
        self._touch(chain, min(have, fits))
        if have >= fits:
            return 0
        # Old blocks go first; never this prompt's own beginning, touched just above.
        keep = {key for key, _ in chain[:have]}
        while self.used_bytes + (fits - have) * per_block > self.capacity_bytes:
            victim = next((key for key in self._blocks if key not in keep), None)
            if victim is None:
                break
            self._evict(victim)
        parent_serial = matched[-1].serial if matched else _ROOT_SERIAL
        added = 0
        for b in range(have, fits):
            key, tokens = chain[b]
            if key in self._blocks:  # another block under the same hash: this prompt's takes its place
                self._evict(key)
            if self.used_bytes + per_block > self.capacity_bytes:
                break
            at = slice(b * size, (b + 1) * size)  # a tensor per block: an evicted block frees its own memory
            block = _Block(next(self._serials), parent_serial, tokens, torch.stack([k[:, at] for k in keys]).cpu(),
                           torch.stack([v[:, at] for v in values]).cpu())
            self._blocks[key] = block
            parent_serial = block.serial
            self.used_bytes += per_block
            added += 1
        # The new blocks were appended first to last; the prefix must be the more recent.
        self._touch(chain, have + added)
        return added

    def _evict(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        self.used_bytes -= 2 * block.keys.numel() * block.keys.element_size()

    def clear(self) -> None:
        self._blocks.clear()
        self.used_bytes = 0
