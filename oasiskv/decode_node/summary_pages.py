"""A request's key summaries, paged into pool rows it owns.

The selection ranks every candidate block of every layer against the summaries at every step,
so they stay in device memory for the request's life. Held outside the pool (as they were, in
float32) they were 1/8 of the request's whole KV in bf16: at 16K on Qwen 1.5B as much as its
2,048-token working set, at 128K eight times it, and no admission check counted them. Paged
into rows of the pool, in the dtype they were read in, `kv_pool_gb` bounds them and a request
waits until its pages fit like its KV rows.

Page p of a request holds blocks p * per_page ... (p + 1) * per_page - 1 of every layer and KV
head (`DevicePool.summary_blocks` per page); a (row, layer, head) slice of a page is one
contiguous run of per_page (lo, hi) pairs, so a layer's candidates are one index_select away.

Read as uint8 codes, the pages hold the codes and the request keeps each channel's offset and
step beside them (2 x 4 bytes per layer, KV head and channel: 114 KiB for Qwen 1.5B, against its
1.5 MiB of codes a 1K-block request). The selection ranks the codes with its query weights times
the steps (the offsets shift every block's logit for a query head alike, which the softmax over
blocks ignores). Write-back summaries are coded on the same ranges; a block outside them widens
the channels it leaves (by a quarter of the new span, so a growing channel re-ranges seldom) and
recodes what is held in those channels. Each recoding rounds outward once more, by at most the
new step; as every widening grows a span by at least a quarter, the steps before the current one
sum to less than four of it, so a held value stays within five current steps of the exact one
(one, in a channel never widened).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kvstore.summary import (
    CODE_LEVELS,
    QuantizedSummaries,
    code_values,
    fits_range,
    narrow_summaries,
    quantize_summaries,
)
from ..models.attention import AttentionBuffers, as_fp32, gather_rows
from .working_set import DevicePool


class SummaryPages:
    def __init__(self, pool: DevicePool, rows: torch.Tensor):
        self.pool = pool
        self.rows = rows.cpu().numpy().astype(np.int64)
        self.num_blocks = 0
        self._heads = np.arange(pool.layout.num_kv_heads)
        self.quantized = pool.summary_dtype == torch.uint8
        # uint8 pages: each channel's range, [layers, kv_heads, 2, head_dim] float32 (None until a first write).
        self.offset: torch.Tensor | None = None
        self.step: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return len(self.rows) * self.pool.summary_blocks

    def write(self, first_block: int, summaries: torch.Tensor | QuantizedSummaries) -> None:
        """Summaries [layers, kv_heads, n, 2, d] of blocks first_block.. (float32, or already in the
        pages' dtype: codes with their ranges for uint8 pages); they become the last blocks held
        (a partly filled block is rewritten)."""
        layout = self.pool.layout
        n = summaries.shape[2]
        if first_block > self.num_blocks or first_block + n > self.capacity:
            raise ValueError(f"summaries of blocks {first_block}..{first_block + n - 1} do not follow the "
                             f"{self.num_blocks} held, within the {self.capacity} these pages hold")
        if n == 0:  # a prompt shorter than a block: nothing summarized yet
            self.num_blocks = first_block
            return
        if self.quantized:
            summaries = self._codes(first_block, summaries)
        elif isinstance(summaries, QuantizedSummaries):
            raise ValueError(f"uint8 summary codes written to {self.pool.summary_dtype} pages")
        elif summaries.dtype != self.pool.summary_dtype:
            summaries = narrow_summaries(summaries.float(), self.pool.summary_dtype)  # as the store narrows them
        flat = self.pool.summary_units
        values = summaries.permute(2, 0, 1, 3, 4).reshape(n, layout.num_layers, layout.num_kv_heads, -1)
        flat[self._slots(first_block, first_block + n)] = values.to(flat.device, flat.dtype)
        self.num_blocks = first_block + n

    def _codes(self, first_block: int, summaries: torch.Tensor | QuantizedSummaries) -> torch.Tensor:
        """What uint8 pages store for these summaries: the codes, on the pages' ranges."""
        if isinstance(summaries, QuantizedSummaries) and (first_block == 0 or self.offset is None):
            self.offset, self.step = summaries.offset.to(self.pool.summary_units.device), summaries.step.to(
                self.pool.summary_units.device)
            return summaries.codes
        if isinstance(summaries, QuantizedSummaries):
            summaries = summaries.dequantize()
        summaries = summaries.float().to(self.pool.summary_units.device)
        if self.offset is None or first_block == 0:
            coded = quantize_summaries(summaries)
            self.offset, self.step = coded.offset, coded.step
            return coded.codes
        fits = fits_range(summaries, self.offset, self.step)
        if not bool(fits.all()):
            self._widen(summaries, ~fits, first_block)
        return quantize_summaries(summaries, self.offset, self.step).codes

    def _widen(self, summaries: torch.Tensor, channels: torch.Tensor, held_blocks: int) -> None:
        """Widen the ranges of `channels` ([layers, kv_heads, 2, d] bool) to take `summaries`, with a
        quarter of the new span to spare, and recode the first `held_blocks` there (those channels
        only: a 32K request holds 2,000 blocks of 14,000 channels, a block leaves a few)."""
        top = self.offset + CODE_LEVELS * self.step
        least, most = summaries.amin(dim=2), summaries.amax(dim=2)
        lo, hi = torch.minimum(least, self.offset), torch.maximum(most, top)
        spare = (hi - lo) / 4
        lo = torch.where(least < self.offset, lo - spare, self.offset)
        hi = torch.where(most > top, hi + spare, top)
        offset = torch.where(channels, lo, self.offset)
        step = torch.where(channels, (hi - lo) / CODE_LEVELS, self.step)
        if held_blocks:
            layers, heads, sides, dims = channels.nonzero(as_tuple=True)  # m channels
            units, positions = self._slots(0, held_blocks)  # [n, layers, heads, 1], [n, 1, 1, 2d]
            where = (units[:, layers, heads, 0], positions[:, 0, 0, sides * self.pool.layout.head_dim + dims])
            flat = self.pool.summary_units
            old = flat[where].float() * self.step[layers, heads, sides, dims] + self.offset[layers, heads, sides, dims]
            flat[where] = code_values(old, offset[layers, heads, sides, dims], step[layers, heads, sides, dims],
                                      sides == 1)
        self.offset, self.step = offset, step

    def blocks(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """Blocks first..end-1 as they are held: [layers, kv_heads, n, 2, head_dim] in the pages'
        dtype (for uint8 pages the codes; `dequantized` gives their values)."""
        layout = self.pool.layout
        end = self.num_blocks if end is None else end
        if not 0 <= first <= end <= self.num_blocks:
            raise ValueError(f"blocks {first}..{end - 1} of {self.num_blocks} summarized")
        held = self.pool.summary_units[self._slots(first, end)]  # [n, layers, heads, 2d]
        return held.view(end - first, layout.num_layers, layout.num_kv_heads, 2, layout.head_dim).permute(1, 2, 0, 3, 4)

    def dequantized(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """Blocks first..end-1 as float32 values (uint8 pages: offset + code * step)."""
        held = self.blocks(first, end)
        if not self.quantized:
            return held.float()
        return QuantizedSummaries(held, self.offset, self.step).dequantize()

    def code_steps(self, layer: int) -> torch.Tensor | None:
        """uint8 pages: `layer`'s steps as [kv_heads, 2 * head_dim], what the query weights are
        multiplied by to rank codes; None for pages that hold values."""
        if not self.quantized or self.step is None:
            return None
        return self.step[layer].reshape(self.pool.layout.num_kv_heads, -1)

    def candidates(self, layer: int, first: int, end: int, buffers: AttentionBuffers | None = None) -> torch.Tensor:
        """Blocks first..end-1 of `layer`: [kv_heads, end - first, 2 * head_dim] float32. With
        `buffers`, the result lives in their reused tensors and is valid until their next use
        under the same names."""
        layout, per_page = self.pool.layout, self.pool.summary_blocks
        if not 0 <= first <= end <= self.num_blocks:
            raise ValueError(f"blocks {first}..{end - 1} of {self.num_blocks} summarized")
        first_page, end_page = first // per_page, -(-end // per_page)
        units = self._units(self.rows[first_page:end_page], np.array([layer]))[:, 0].T  # [heads, pages]
        flat = self.pool.summary_units
        index = torch.from_numpy(np.ascontiguousarray(units).reshape(-1)).to(flat.device)
        gathered = as_fp32(gather_rows(flat, index, buffers, "summary pages"), "summary pages fp32", buffers)
        run = gathered.view(layout.num_kv_heads, -1, 2 * layout.head_dim)
        start = first - first_page * per_page
        return run[:, start : start + end - first]

    def _units(self, rows: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """[len(rows), len(layers), kv_heads] indices into `pool.summary_units`."""
        layout = self.pool.layout
        return (rows[:, None, None] * layout.num_layers + layers[None, :, None]) * layout.num_kv_heads + self._heads

    def _slots(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where blocks first..end-1 of every layer and head lie in `pool.summary_units`: an index
        pair selecting [n, layers, heads, 2 * head_dim]."""
        layout, per_page = self.pool.layout, self.pool.summary_blocks
        blocks = np.arange(first, end)
        units = self._units(self.rows[blocks // per_page], np.arange(layout.num_layers))  # [n, layers, heads]
        pairs = 2 * layout.head_dim
        offsets = (blocks % per_page)[:, None, None, None] * pairs + np.arange(pairs)  # [n, 1, 1, 2d]
        device = self.pool.summary_units.device
        return torch.from_numpy(units[..., None]).to(device), torch.from_numpy(offsets).to(device)


class PagedLayer:
    """One layer of a request's summary pages, shaped like the [kv_heads, blocks, 2, head_dim]
    tensor `lookahead.Selection` takes; `candidates` gathers a run of it."""

    def __init__(self, pages: SummaryPages, layer: int, buffers: AttentionBuffers | None = None):
        self.pages = pages
        self.layer = layer
        self.buffers = buffers

    @property
    def shape(self) -> tuple[int, int, int, int]:
        layout = self.pages.pool.layout
        return (layout.num_kv_heads, self.pages.num_blocks, 2, layout.head_dim)

    @property
    def device(self) -> torch.device:
        return self.pages.pool.summary_units.device

    def candidates(self, first: int, end: int) -> torch.Tensor:
        return self.pages.candidates(self.layer, first, end, self.buffers)

    def code_steps(self) -> torch.Tensor | None:
        return self.pages.code_steps(self.layer)
