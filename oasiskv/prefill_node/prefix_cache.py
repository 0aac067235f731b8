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

The KV lives in one slab of `capacity_bytes // bytes per block` slots, allocated at the first
insert and filled as blocks come (the OS commits its pages on first touch): a block a tensor of
its own left the allocator's holes between live blocks, and the worker's memory grew to 1.5-2.6x
the capacity. Blocks move in and out a layer at a time for all of a prompt's blocks at once.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import torch

_ROOT_KEY = b""  # the parent key of every prompt's first block
_ROOT_SERIAL = 0


@dataclass
class _Block:
    serial: int  # never reused: a block that takes an evicted one's key is not its children's parent
    parent_serial: int
    tokens: tuple[int, ...]
    slot: int  # in the slab


@dataclass
class PrefixHit:
    """The cached beginning of a prompt: `tokens` tokens, in these slots of the slab, first to last."""

    tokens: int
    slots: torch.Tensor | None = None
    slab: torch.Tensor | None = None  # [slots, layers, 2, kv_heads, block_size, head_dim]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of the hit, [kv_heads, tokens, head_dim] each: a layer at a time,
        so a long hit is never copied whole a second time."""
        kv = self.slab[self.slots, layer]  # [blocks, 2, kv_heads, block_size, head_dim]
        blocks, _, heads, size, dim = kv.shape
        kv = kv.permute(1, 2, 0, 3, 4).reshape(2, heads, blocks * size, dim)
        return kv[0], kv[1]


class PrefixCache:
    def __init__(self, capacity_bytes: int, block_size: int):
        if capacity_bytes < 0:
            raise ValueError(f"the prefix cache's capacity must be at least 0 bytes, got {capacity_bytes}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.capacity_bytes = int(capacity_bytes)
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._serials = count(_ROOT_SERIAL + 1)
        self._slab: torch.Tensor | None = None
        self._free_slots: list[int] = []

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
        return PrefixHit(len(found) * self.block_size, torch.tensor([b.slot for b in found]), self._slab)

    def insert(self, prompt_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Keep the KV of `prompt_ids`' full blocks; `keys[layer]` / `values[layer]` are
        [kv_heads, >= len(prompt_ids), head_dim], token i at index i. Returns the blocks added.
        Blocks already cached are only touched; older blocks are evicted to make room, and a
        prompt larger than the whole cache keeps only the beginning that fits."""
        if not self.enabled:
            return 0
        size = self.block_size
        slab = self._slab_for(keys)
        if slab is None:
            return 0
        chain = self._chain(prompt_ids, len(prompt_ids) // size)
        matched = self._matched(chain)
        have = len(matched)
        fits = min(len(chain), slab.shape[0])
        self._touch(chain, min(have, fits))
        if have >= fits:
            return 0
        new = chain[have:fits]
        for key, _ in new:
            if key in self._blocks:  # another block under the same hash: this prompt's takes its place
                self._evict(key)
        # Old blocks go first; never this prompt's own beginning, touched just above.
        keep = {key for key, _ in chain[:have]}
        while len(self._free_slots) < len(new):
            self._evict(next(key for key in self._blocks if key not in keep))
        slots = [self._free_slots.pop() for _ in new]
        try:
            self._copy_in(slots, keys, values, have * size, fits * size)
        except BaseException:  # nothing was registered: the slots hold no block anyone can find
            self._free_slots.extend(reversed(slots))
            raise
        parent_serial = matched[-1].serial if matched else _ROOT_SERIAL
        for (key, tokens), slot in zip(new, slots):
            block = _Block(next(self._serials), parent_serial, tokens, slot)
            self._blocks[key] = block
            parent_serial = block.serial
        # The new blocks were appended first to last; the prefix must be the more recent.
        self._touch(chain, fits)
        return len(new)

    def _copy_in(self, slots: list[int], keys, values, start: int, stop: int) -> None:
        """Tokens [start, stop) of every layer's K and V into `slots`, a block each, a layer at a time."""
        index, size = torch.tensor(slots), self.block_size
        for layer, pair in enumerate(zip(keys, values)):
            for part, tensor in enumerate(pair):  # [kv_heads, tokens, head_dim] -> [blocks, kv_heads, size, head_dim]
                heads, _, dim = tensor.shape
                blocks = tensor[:, start:stop].cpu().view(heads, len(slots), size, dim).transpose(0, 1)
                self._slab[index, layer, part] = blocks

    @property
    def used_bytes(self) -> int:
        return 0 if self._slab is None else len(self._blocks) * self._slab[0].numel() * self._slab.element_size()

    def _slab_for(self, keys: list[torch.Tensor]) -> torch.Tensor | None:
        """The slab, made at the first insert from the shape of the KV; None when the capacity
        holds not one block."""
        heads, _, dim = keys[0].shape
        shape = (len(keys), 2, heads, self.block_size, dim)
        if self._slab is None:
            per_block = torch.Size(shape).numel() * keys[0].element_size()
            slots = self.capacity_bytes // per_block
            if slots == 0:
                return None
            self._slab = torch.empty((slots, *shape), dtype=keys[0].dtype)
            self._free_slots = list(range(slots - 1, -1, -1))
        elif tuple(self._slab.shape[1:]) != shape or self._slab.dtype != keys[0].dtype:
            raise ValueError(f"this prefix cache holds blocks of {tuple(self._slab.shape[1:])} {self._slab.dtype}, "
                             f"not {shape} {keys[0].dtype}: one cache serves one model")
        return self._slab

    def _evict(self, key: bytes) -> None:
        self._free_slots.append(self._blocks.pop(key).slot)

    def clear(self) -> None:
        self._blocks.clear()
        if self._slab is not None:
            self._free_slots = list(range(self._slab.shape[0] - 1, -1, -1))
