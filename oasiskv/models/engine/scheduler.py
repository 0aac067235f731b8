"""Continuous batching: which sequences run in the next step and how many tokens each feeds.

A step is either a prefill step (prompt chunks of waiting sequences, up to
`max_num_batched_tokens`) or a decode step (one token for every running sequence). Prefill goes
first so new requests start quickly; a long prompt is split across steps (chunked prefill).

When a running sequence needs a block and none is free, blocks are taken back, cheapest loss first:
- the last blocks of partly prefilled waiting sequences, newest first: nothing was sampled from
  them yet, and only the chunks in those blocks are prefilled again;
- then the newest running sequence is preempted: its blocks are freed and it goes back to the
  front of the queue, to be recomputed from its prompt and the tokens it already produced.

This keeps the engine from stalling. Only the last sequence of a prefill step can stop partway
(those before it took all their tokens), and a preemption comes only once no waiting sequence
holds blocks, so at most the front of the queue holds any. With nothing running it has the cache
to itself, and every request fits that alone (`add` checks); the oldest running sequence, for the
same reason, is never preempted. (Preempted sequences used to go in front of partly prefilled ones
that kept their blocks, until the queue held the cache with nothing running and waited forever.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..kv_cache import BlockAllocator
from .sequence import Sequence, SequenceStatus


class RequestTooLarge(ValueError):
    """A request can never fit: its prompt plus max_tokens exceeds the whole KV cache or the model's context."""


@dataclass
class ScheduledBatch:
    sequences: list[Sequence]
    num_new: list[int]  # tokens each sequence feeds this step
    is_prefill: bool

    def samples(self, seq: Sequence, num_new: int) -> bool:
        """Whether this step yields a token for `seq` (a prefill chunk that ends the prompt does)."""
        return not self.is_prefill or seq.num_cached + num_new == seq.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        total_blocks = -(-(len(seq.prompt_ids) + seq.params.max_tokens) // self.block_size)
        if total_blocks > self.allocator.num_blocks:
            raise RequestTooLarge(
                f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.params.max_tokens}) needs "
                f"{total_blocks} KV blocks; the cache has {self.allocator.num_blocks}"
            )
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch; None only when no request is left (see the module's note)."""
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        chosen, counts = [], []
        for seq in self.waiting:
            if budget == 0 or len(self.running) + len(chosen) >= self.max_num_seqs:
                break
            chunk = min(seq.num_tokens - seq.num_cached, budget)
            needed = seq.blocks_needed(seq.num_cached + chunk, self.block_size)
            if needed > self.allocator.num_free:
                break  # keep arrival order: later requests wait behind this one
            seq.block_table += self.allocator.allocate(needed)
            chosen.append(seq)
            counts.append(chunk)
            budget -= chunk
        return ScheduledBatch(chosen, counts, is_prefill=True) if chosen else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below while making room
                continue
            needed = seq.blocks_needed(seq.num_tokens, self.block_size)
            # Waiting chunks go before any running sequence: nothing was sampled from them yet,
            # and a queue left holding blocks behind preempted sequences can stall for good.
            self._reclaim_from_waiting(needed)
            while needed > self.allocator.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seq.block_table += self.allocator.allocate(needed)
                scheduled.append(seq)
        if not scheduled:
            return None
        return ScheduledBatch(scheduled, [1] * len(scheduled), is_prefill=False)

    def _reclaim_from_waiting(self, num_blocks: int) -> None:
        """Take the last blocks of partly prefilled waiting sequences, newest first, until
        `num_blocks` are free. Only the chunks whose blocks are taken are prefilled again: the
        K/V of the blocks kept stays valid, and they keep their place in the queue."""
        for seq in reversed(self.waiting):
            missing = num_blocks - self.allocator.num_free
            if missing <= 0:
                return
            if not seq.block_table:
                continue
            kept = max(0, len(seq.block_table) - missing)
            self.allocator.free(seq.block_table[kept:])
            del seq.block_table[kept:]
            seq.num_cached = min(seq.num_cached, kept * self.block_size)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Account for the K/V written this step and move fully prefilled sequences to running."""
        for seq, count in zip(batch.sequences, batch.num_new):
            seq.num_cached += count
            if batch.is_prefill and seq.num_cached == seq.num_tokens and seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
