"""The device KV pool and each request's working set in it.

The pool is `[rows, layers, kv_heads, 2, block_size, head_dim]`: a *row* holds one block slot
for every (layer, KV head), and each (layer, KV head) decides on its own which logical block its
slot of the row holds. A request owns a fixed set of rows for its whole life:

    [ sink rows | window ring (window_blocks + 1 rows) | budget rows | summary pages ]

- sink rows hold the first blocks (attention sinks), always;
- the ring holds the most recent blocks, which the decode node writes itself (block b lives in
  ring row (b - sinks) % ring); the one spare row takes draft tokens that spill into the next
  block without overwriting the window;
- budget rows hold the selected blocks (top-K per layer and KV head), replaced as the selection
  moves;
- summary pages hold the request's key summaries (`summary_pages.SummaryPages`), every block's
  that the request can reach: the selection ranks against them at every step, so they live in
  device memory too, and in the pool, so `kv_pool_gb` bounds them and admission counts them.

`dense` is the same structure with no sinks, no budget, no summaries, and a ring as long as the
request.
A request is admitted only when its rows are free, so the pool never over-commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kvstore import KVLayout
from ..kvstore.summary import summary_read_dtype
from ..models.attention import PAD_POSITION, first_visible_block
from ..models.kv_cache import BlockAllocator

EMPTY = -1


def summary_blocks_per_row(block_size: int, kv_itemsize: int, summary_itemsize: int) -> int:
    """How many blocks' summaries (every layer and KV head) one pool row holds: a row is
    block_size keys and values per (layer, head), a summary two vectors of summary_itemsize."""
    if block_size * kv_itemsize % summary_itemsize:
        raise ValueError(f"a pool row of {block_size}-token blocks in {kv_itemsize}-byte KV does not hold a whole "
                         f"number of {summary_itemsize}-byte key summaries; use an even block_size or read "
                         "summaries as bfloat16")
    return block_size * kv_itemsize // summary_itemsize


class DevicePool:
    def __init__(self, layout: KVLayout, pool_bytes: int, device: str | torch.device = "cpu",
                 summary_dtype: torch.dtype = torch.bfloat16):
        self.layout = layout
        row_bytes = layout.num_layers * layout.num_kv_heads * layout.unit_bytes
        self.num_rows = pool_bytes // row_bytes
        if self.num_rows < 1:
            raise ValueError(f"kv_pool_gb: a KV pool of {pool_bytes} bytes holds no row of this model's KV "
                             f"({row_bytes} bytes each: one block of every layer and KV head); give it at least "
                             f"{row_bytes / 2**30:.3g}")
        self.row_bytes = row_bytes
        shape = (self.num_rows, layout.num_layers, layout.num_kv_heads, 2, layout.block_size, layout.head_dim)
        self.tensor = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.units = self.tensor.view(-1, 2, layout.block_size, layout.head_dim)
        self.allocator = BlockAllocator(self.num_rows)
        # The same memory seen as summary pages: per row and (layer, head), `summary_blocks` blocks'
        # (lo, hi) pairs, flattened to [rows * layers * kv_heads, summary_blocks * 2 * head_dim].
        self.summary_dtype = summary_dtype
        self.summary_blocks = summary_blocks_per_row(layout.block_size, layout.itemsize, summary_dtype.itemsize)
        self.summary_units = self.tensor.view(-1, 2 * layout.block_size * layout.head_dim).view(summary_dtype)

    def unit_ids(self, rows: torch.Tensor, layer: int, head: torch.Tensor | int) -> torch.Tensor:
        """Flat unit index of (row, layer, head): where a store read lands."""
        return (rows * self.layout.num_layers + layer) * self.layout.num_kv_heads + head

    def clear_rows(self, rows: torch.Tensor) -> None:
        """Zero whole rows. Attention reads every row a request owns and masks the keys it must
        not see, but a masked value still enters the weighted sum times zero, and 0 x NaN is NaN:
        a row that last held another request's summary pages (bytes that read as NaN in the KV
        dtype) must not reach attention unwritten."""
        if rows.numel():
            self.tensor[rows.to(self.tensor.device)] = 0

    @property
    def rows_used(self) -> int:
        return self.num_rows - self.allocator.num_free


@dataclass
class RowPlan:
    """How many rows of each role a request gets."""

    sinks: int
    ring: int
    budget: int
    summary_pages: int = 0

    @property
    def kv_rows(self) -> int:
        return self.sinks + self.ring + self.budget

    @property
    def total(self) -> int:
        return self.kv_rows + self.summary_pages


def plan_rows(config, prompt_tokens: int, max_tokens: int, mode: str | None = None,
              budget_tokens: int | None = None, *, kv_itemsize: int) -> RowPlan:
    """Rows a request needs in a decode pool (config: a DecodeConfig; kv_itemsize: bytes per
    element of the pool's KV). Shared by the engine's admission and the cluster router's
    accounting, so both agree on what fits."""
    bs = config.block_size
    blocks = -(-(prompt_tokens + max_tokens + config.num_draft_tokens + 1) // bs)  # all it can reach
    if (mode or config.mode) == "dense":
        return RowPlan(sinks=0, ring=blocks + 1, budget=0)
    # A request never has more blocks to select from than it can reach past its sinks: rows for
    # the whole budget made a short request in a sparse mode need 135 rows where dense needs 5.
    budget = min((budget_tokens or config.budget_tokens) // bs, max(0, blocks - config.sink_blocks))
    per_page = summary_blocks_per_row(bs, kv_itemsize, summary_read_dtype(config.summary_read_dtype).itemsize)
    return RowPlan(sinks=config.sink_blocks, ring=config.window_blocks + 1, budget=budget,
                   summary_pages=-(-blocks // per_page))


@dataclass
class WorkingSet:
    request_id: str
    rows: torch.Tensor  # [R] pool rows owned, in role order (`kv_rows` first, then the summary pages)
    plan: RowPlan
    num_layers: int
    num_kv_heads: int
    block_size: int
    # Logical block held by (layer, head, row index); EMPTY when none.
    blocks: torch.Tensor = field(init=False)
    # Step at which (layer, head, row index) was last selected: eviction is least-recently-selected.
    last_selected: torch.Tensor = field(init=False)
    # Rows whose block is still in flight, per layer (cleared when the layer's fetch completes).
    in_flight: torch.Tensor = field(init=False)
    pending: list = field(init=False)  # per layer: TransferHandle | None
    # Per layer: the fraction of a block replacement not yet spent (see lookahead.replacement_cap).
    replace_credit: list = field(init=False)
    # The first transfer into these rows that failed (its store died, say): the rows hold no
    # usable KV, so the engine ends the request after the step, and plans nothing more for it.
    failure: Exception | None = field(default=None, init=False)

    def __post_init__(self):
        shape = (self.num_layers, self.num_kv_heads, self.plan.kv_rows)
        self.blocks = torch.full(shape, EMPTY, dtype=torch.long)
        self.last_selected = torch.zeros(shape, dtype=torch.long)
        self.in_flight = torch.zeros(shape, dtype=torch.bool)
        self.pending = [None] * self.num_layers
        self.replace_credit = [0.0] * self.num_layers

    # -- roles ---------------------------------------------------------------------------
    @property
    def kv_rows(self) -> torch.Tensor:
        """The rows that hold KV (sinks, ring, budget), in role order."""
        return self.rows[: self.plan.kv_rows]

    @property
    def summary_rows(self) -> torch.Tensor:
        return self.rows[self.plan.kv_rows :]

    @property
    def budget_slice(self) -> slice:
        return slice(self.plan.sinks + self.plan.ring, self.plan.kv_rows)

    def ring_index(self, block: int) -> int:
        """Row index that holds `block` while it is written locally (sink blocks keep their own row)."""
        if block < self.plan.sinks:
            return block
        return self.plan.sinks + (block - self.plan.sinks) % self.plan.ring

    def is_sink(self, block: int) -> bool:
        return block < self.plan.sinks

    def set_everywhere(self, row_index: int, block: int) -> None:
        """Row `row_index` holds `block` for every layer and head (sinks, the ring)."""
        self.blocks[:, :, row_index] = block

    def window_blocks(self, tail_block: int) -> range:
        """Blocks that the ring keeps resident while `tail_block` is the newest block."""
        first = max(self.plan.sinks, tail_block - (self.plan.ring - 1) + 1)
        return range(first, tail_block + 1)

    def first_candidate_block(self, query_position: int, window: int | None) -> int:
        """The first block a layer ranks for a query at `query_position`: past the sinks and, in
        a sliding-window layer, past the blocks that query may no longer see."""
        if window is None:
            return self.plan.sinks
        return max(self.plan.sinks, first_visible_block(query_position, window, self.block_size))

    def attended_budget_blocks(self, layer: int) -> torch.Tensor:
        """[kv_heads, budget rows] a copy of the blocks `layer`'s budget rows show attention now:
        EMPTY where none, or where a fetch is still landing (masked, as in `key_positions`)."""
        budget = self.budget_slice
        blocks = self.blocks[layer, :, budget].clone()
        blocks[self.in_flight[layer, :, budget]] = EMPTY
        return blocks

    def key_positions(self, layer: int) -> torch.Tensor:
        """[kv_heads, R * block_size] position of every key slot (padding for empty or in-flight rows)."""
        blocks = self.blocks[layer]
        offsets = torch.arange(self.block_size)
        positions = blocks[:, :, None] * self.block_size + offsets
        hidden = (blocks == EMPTY) | self.in_flight[layer]
        return positions.masked_fill(hidden[:, :, None], PAD_POSITION).reshape(self.num_kv_heads, -1)
