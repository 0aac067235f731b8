"""Which prefill worker was last sent a prompt's beginning, so that a prompt that begins the same
way (a chat's next turn, the other choices of n > 1) can go where that worker's prefix cache
holds its KV.

Each prompt is remembered when it is assigned, under hashes of its first 64, 128, 256, ...
tokens and of all its whole blocks before its last token (the most a prefix cache can serve),
and forgotten for that worker if its prefill fails. A lookup takes the longest of those a
remembered prompt shares: at least half of what the two share, all of it for the same prompt
again. The cache may have evicted it since (or the worker restarted empty): the prompt is then
computed whole there, once, and is in that cache again. Beginnings shorter than 64 tokens are
not used: a system prompt every conversation shares would send them all to one worker.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

MIN_TOKENS = 64


def prefix_keys(prompt_ids: list[int], block_tokens: int = 16) -> list[tuple[int, bytes]]:
    """(tokens, hash of the prompt's first that many tokens): 64, 128, 256, ... and the prompt's
    whole blocks (of the prefix caches' `block_tokens`) before its last token, shortest first."""
    usable = (len(prompt_ids) - 1) // block_tokens * block_tokens
    lengths = []
    length = MIN_TOKENS
    while length < usable:
        lengths.append(length)
        length *= 2
    if usable >= MIN_TOKENS:
        lengths.append(usable)
    keys, digest, done = [], hashlib.blake2b(digest_size=16), 0
    for length in lengths:
        digest.update(array("q", prompt_ids[done:length]).tobytes())
        # The length is part of the key: the first 64 tokens of one prompt and the whole of
        # another are not the same beginning, though their bytes so far are.
        keys.append((length, digest.copy().digest() + length.to_bytes(8, "little")))
        done = length
    return keys


class PrefixAffinity:
    def __init__(self, max_entries: int = 65536, block_tokens: int = 16):
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.block_tokens = block_tokens
        self._owners: OrderedDict[bytes, str] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._owners)

    def keys(self, prompt_ids: list[int]) -> list[tuple[int, bytes]]:
        """The prompt's beginnings, hashed once per request (a 128K-token prompt takes ~4 ms)."""
        return prefix_keys(prompt_ids, self.block_tokens)

    def worker_for(self, keys: list[tuple[int, bytes]]) -> tuple[str, int] | None:
        """(worker, tokens): the worker a prompt of these `keys` was last sent to with the longest
        beginning it shares, and that beginning's length in whole blocks."""
        for length, key in reversed(keys):
            worker = self._owners.get(key)
            if worker is not None:
                self._owners.move_to_end(key)
                return worker, length // self.block_tokens * self.block_tokens
        return None

    def remember(self, keys: list[tuple[int, bytes]], worker: str) -> None:
        for _, key in keys:
            self._owners[key] = worker
            self._owners.move_to_end(key)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def forget(self, keys: list[tuple[int, bytes]], worker: str) -> None:
        """Drop what says `worker` holds these beginnings: its prefill of them failed."""
        for _, key in keys:
            if self._owners.get(key) == worker:
                del self._owners[key]
