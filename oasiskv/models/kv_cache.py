"""Paged KV cache: fixed-size blocks of `block_size` token slots, handed out by a free list.

Layout per layer: K and V are each `[kv_heads, num_blocks * block_size, head_dim]`. Keeping the
KV-head axis outermost lets one gather serve every head (dense decode) and lets a caller give
each KV head its own slots (the decode node's per-head working set) with the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks; the scheduler waits or preempts instead of failing."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, all layers and KV heads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * itemsize

    def blocks_for_bytes(self, budget_bytes: int) -> int:
        return max(1, budget_bytes // self.bytes_per_block)


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (spec.num_kv_heads, num_blocks * spec.block_size, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.allocator = BlockAllocator(num_blocks)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] written at flat slot ids [tokens]."""
        self.k[layer][:, slots] = k.transpose(0, 1).to(self.spec.dtype)
        self.v[layer][:, slots] = v.transpose(0, 1).to(self.spec.dtype)
