"""Where a sparse run loses attention, layer by layer and KV head by KV head: the diagnostic of
`bench/sparse_quality.py --attention-mass`.

The decode engine records, for every row it verifies, which blocks each (layer, KV head) held
when the row attended (`ResidentSets`); one dense forward of the same teacher-forced
continuation gives every row's exact attention per block. Averaged over the rows, per
(layer, KV head):

- `window`: the attention on the sinks and the window, which every mode holds;
- `ideal`: the attention on the row's own exact top-K of the remaining blocks, the most that
  any selection of K blocks can hold;
- `resident`: the attention on the blocks of the remaining ones that the run held.

`ideal - resident` is what the run's selection (prediction, shared set, replacement cap)
missed there. Agreement alone says a run lost tokens; this says in which heads, so a change to
the selection can be aimed and checked.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from oasiskv.decode_node.attention import SparseAttention
from oasiskv.decode_node.working_set import EMPTY


class ResidentSets:
    """The blocks every (layer, KV head) held when each row attended, recorded from the engine
    (its only request): `blocks[(layer, position)]` is [kv_heads, rows] of block ids."""

    def __init__(self):
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}

    @contextlib.contextmanager
    def recording(self):
        """Record while the block is open. The engine has no hook for it, so its resident
        attention is wrapped here, in this process only (as sparse_quality's TeacherForcing
        wraps `verify`)."""
        original = SparseAttention._attend_resident
        sets = self.blocks

        def attend_resident(backend, layer, q):
            for req in backend.requests:
                held = req.ws.blocks[layer].clone()
                # Rows still landing are masked from attention under `skip`: not held (counted
                # as held, skip's loss read about a sixth too small).
                held[req.ws.in_flight[layer]] = EMPTY
                for position in req.positions.tolist():
                    sets[(layer, position)] = held
            return original(backend, layer, q)

        SparseAttention._attend_resident = attend_resident
        try:
            yield self
        finally:
            SparseAttention._attend_resident = original


def block_mass(probs: torch.Tensor, block_size: int) -> torch.Tensor:
    """probs [kv_heads, rows, group, L] (each query head's softmax over L keys) -> [kv_heads, rows,
    blocks]: each block's share of the group's attention (a row's shares sum to 1)."""
    kv_heads, rows, group, length = probs.shape
    blocks = -(-length // block_size)
    mass = torch.nn.functional.pad(probs.sum(dim=2) / group, (0, blocks * block_size - length))
    return mass.view(kv_heads, rows, blocks, block_size).sum(-1)


def selectable_blocks(positions: torch.Tensor, num_blocks: int, block_size: int, sinks: int,
                      window: int, sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row at `positions`: which of `num_blocks` blocks a selection chooses among (after the
    sinks, before the row's window, and in a `sliding_window` layer not before the first block
    the row may see, as the decode node ranks) and which are held anyway (the sinks, the window
    up to the row's own block); both [rows, blocks]."""
    ids = torch.arange(num_blocks)[None]
    tails = (positions // block_size)[:, None]
    window_start = (tails - window + 1).clamp(min=sinks)
    first = torch.full_like(tails, sinks)
    if sliding_window is not None:
        first = first.clamp(min=(positions[:, None] - sliding_window + 1).clamp(min=0) // block_size)
    candidate = (ids >= first) & (ids < window_start)
    always = (ids < sinks) | ((ids >= window_start) & (ids <= tails))
    return candidate, always


def mass_by_head(mass: dict[int, torch.Tensor], positions: torch.Tensor, resident: ResidentSets, block_size: int,
                 sinks: int, window: int, budget_blocks: int) -> dict:
    """mass: per layer, [kv_heads, rows, blocks] of the dense forward whose rows sit at
    `positions`. Rows the run did not verify (its last token) are left out. Returns per
    (layer, KV head) means over the rows: window, ideal, resident (lists [layers][kv_heads]),
    and how many rows were averaged."""
    out = {"window": [], "ideal": [], "resident": []}
    rows_seen = 0
    for layer in sorted(mass):
        m = mass[layer]
        kv_heads, _, num_blocks = m.shape
        candidate, always = selectable_blocks(positions, num_blocks, block_size, sinks, window)
        held = torch.zeros_like(m, dtype=torch.bool)
        seen = torch.zeros(len(positions), dtype=torch.bool)
        for r, position in enumerate(positions.tolist()):
            blocks = resident.blocks.get((layer, position))
            if blocks is None:
                continue
            seen[r] = True
            for h in range(kv_heads):
                kept = blocks[h][(blocks[h] != EMPTY) & (blocks[h] < num_blocks)]
                held[h, r, kept] = True
        in_candidates = m * candidate[None]
        k = max(1, min(budget_blocks, num_blocks))
        ideal = in_candidates.topk(k, dim=-1).values.sum(-1)  # [kv_heads, rows]
        got = (in_candidates * held).sum(-1)
        on_window = (m * always[None]).sum(-1)
        rows_seen = int(seen.sum())
        for name, value in (("window", on_window), ("ideal", ideal), ("resident", got)):
            out[name].append(value[:, seen].mean(dim=1).tolist())
    out["rows"] = rows_seen
    return out


def summarize_mass(by_head: dict, worst: int = 5) -> dict:
    """The run's missed attention (ideal - resident) averaged over layers and heads, per layer,
    and its `worst` (layer, KV head) pairs."""
    ideal, got = np.array(by_head["ideal"]), np.array(by_head["resident"])
    missed = ideal - got  # [layers, kv_heads]
    order = np.argsort(missed, axis=None)[::-1][:worst]
    pairs = [{"layer": int(i // missed.shape[1]), "kv_head": int(i % missed.shape[1]),
              "missed": float(missed.flat[i]), "ideal": float(ideal.flat[i])} for i in order]
    return {"missed_mean": float(missed.mean()), "ideal_mean": float(ideal.mean()),
            "missed_by_layer": missed.mean(axis=1).tolist(), "worst": pairs}
