"""`oasiskv bench serve`: a load generator for any OpenAI-compatible endpoint (OasisKV's API, vLLM's).

It streams every request (server-sent events) and times the raw SSE chunks with httpx, so it
measures what a client sees: time to first token, inter-token latency, time per output token and
end-to-end latency, plus request/token throughput and goodput under SLOs; the report follows
`vllm bench serve`, so the two can be compared line by line.

Modules: arrivals (when requests are sent), datasets (what is sent), sse (one streamed request),
runner (the schedule, concurrency and time limits), stats (percentiles, summary, goodput),
report (text and JSON), plot (PNG), cli (arguments, `run_bench`).
"""

from .cli import add_arguments_bench, run_bench

__all__ = ["add_arguments_bench", "run_bench"]
