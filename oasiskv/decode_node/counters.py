"""What the decode node counts; the cluster exports these as Prometheus metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DecodeCounters:
    steps: int = 0
    generated_tokens: int = 0
    blocks_fetched: int = 0
    bytes_fetched: int = 0
    admission_bytes_fetched: int = 0
    # Key summaries read at admission (sparse modes): not KV, but bytes moved from the store.
    summary_bytes_fetched: int = 0
    blocks_written_back: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    prefetch_waits: int = 0  # look-ahead prefetches not landed when their layer ran (miss policy "wait")
    on_demand_waits: int = 0  # fetches issued and waited for in the same layer (sparse-current, top-up)
    prefetch_skips: int = 0
    fetch_wait_s: float = 0.0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    # Requests whose store could not be told to free them (it had died, say); logged each time.
    store_free_failures: int = 0
    recall_sum: float = 0.0
    recall_samples: int = 0

    def add_recall(self, value: float) -> None:
        self.recall_sum += value
        self.recall_samples += 1

    @property
    def prediction_recall(self) -> float | None:
        return self.recall_sum / self.recall_samples if self.recall_samples else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else None

    @property
    def bytes_per_token(self) -> float | None:
        total = self.bytes_fetched + self.admission_bytes_fetched + self.summary_bytes_fetched
        return total / self.generated_tokens if self.generated_tokens else None

    def snapshot(self) -> dict:
        return {
            **asdict(self),
            "prediction_recall": self.prediction_recall,
            "acceptance_rate": self.acceptance_rate,
            "bytes_per_token": self.bytes_per_token,
        }
