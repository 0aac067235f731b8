"""One request's state inside the engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not (fully) prefilled yet
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    text: str = ""  # detokenized output, cut at a stop string
    output_text: object | None = None  # its incremental decoder (stopping.OutputText), made by the engine
    generator: torch.Generator | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprob of each output token, when asked for
    grammar: object | None = None  # its structured output's matcher (structured_output.GrammarState)
    seq_id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"seq-{self.seq_id}"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Extra blocks to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))
