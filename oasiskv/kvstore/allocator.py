"""Chunk allocator over the arena: a sorted free list of extents.

Requests of different models have different chunk sizes, so the arena is not cut into fixed
pages. allocate(count, size) carves as many whole chunks as fit from each free extent in
address order: a fresh or defragmented arena yields one contiguous run per request (copies
merge), a fragmented one still serves the request from the holes. release() puts chunks back
and coalesces neighbours, so freeing everything restores one extent.
"""

from __future__ import annotations

import bisect

import numpy as np

from .errors import StoreFull


class ExtentAllocator:
    def __init__(self, capacity: int, align: int):
        self.align = align
        self.capacity = capacity - capacity % align
        # Parallel sorted lists: extent start offsets and their lengths.
        self._starts: list[int] = [0] if self.capacity else []
        self._lengths: list[int] = [self.capacity] if self.capacity else []
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def num_extents(self) -> int:
        return len(self._starts)

    def fits(self, count: int, size: int) -> int:
        """How many chunks of `size` bytes the free extents can hold, capped at count."""
        total = 0
        for length in self._lengths:
            total += length // size
            if total >= count:
                return count
        return total

    def allocate(self, count: int, size: int) -> np.ndarray:
        """Byte offsets of `count` chunks of `size` bytes, or StoreFull."""
        if size <= 0 or size % self.align:
            raise ValueError(f"chunk size {size} must be a positive multiple of {self.align}")
        if count <= 0:
            return np.zeros(0, np.int64)
        available = self.fits(count, size)
        if available < count:
            needed = count * size
            hint = "" if self.free_bytes < needed else " (free space is fragmented into smaller holes)"
            raise StoreFull(
                f"store full: need {needed} bytes ({count} blocks x {size} B), "
                f"{self.free_bytes} of {self.capacity} bytes free{hint}",
                needed_bytes=needed, free_bytes=self.free_bytes, capacity_bytes=self.capacity,
            )
        pieces = []
        remaining = count
        i = 0
        while remaining:
            take = min(remaining, self._lengths[i] // size)
            if take == 0:
                i += 1
                continue
            start = self._starts[i]
            pieces.append(start + np.arange(take, dtype=np.int64) * size)
            remaining -= take
            if take * size == self._lengths[i]:
                del self._starts[i], self._lengths[i]
            else:
                self._starts[i] += take * size
                self._lengths[i] -= take * size
                i += 1
        self.used_bytes += count * size
        return np.concatenate(pieces)

    def release(self, offsets: np.ndarray, size: int) -> None:
        if offsets.size == 0:
            return
        ordered = np.sort(offsets.astype(np.int64))
        breaks = np.flatnonzero(np.diff(ordered) != size) + 1
        run_starts = ordered[np.concatenate(([0], breaks))]
        run_counts = np.diff(np.concatenate(([0], breaks, [ordered.size])))
        for start, run in zip(run_starts.tolist(), run_counts.tolist()):
            self._insert(start, run * size)
        self.used_bytes -= ordered.size * size

    def _insert(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        # Overlap with a free extent means a double free: a bug in the caller, never silent.
        if i < len(self._starts) and start + length > self._starts[i]:
            raise RuntimeError(f"double free of arena range [{start}, {start + length})")
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start:
            raise RuntimeError(f"double free of arena range [{start}, {start + length})")
        merge_left = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        merge_right = i < len(self._starts) and start + length == self._starts[i]
        if merge_left and merge_right:
            self._lengths[i - 1] += length + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_left:
            self._lengths[i - 1] += length
        elif merge_right:
            self._starts[i] = start
            self._lengths[i] += length
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, length)
