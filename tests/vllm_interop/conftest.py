"""The vLLM interop suite: vLLM on this CPU (the vllm extra, installed by scripts/test-vllm.sh
into .venv-vllm) prefilling through OasisKVConnector into a real store. Skipped, with the
reason, in an environment without vLLM."""

from __future__ import annotations

import os

import pytest

# In-process engine: the connector's worker half runs in the test process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

pytest.importorskip("vllm", reason="the vllm extra is not installed: run scripts/test-vllm.sh")


@pytest.fixture(scope="session")
def nixl_store():
    """A real store server, reached over NIXL (TCP for control)."""
    from oasiskv.kvstore import KVStoreServer

    server = KVStoreServer(capacity_gb=0.5, transport="nixl")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_prefill(smollm2_dir):
    """One vLLM prefill instance for the suite; chunks of 256 tokens so prompts span several steps."""
    from oasiskv.prefill_node.vllm_worker import VLLMPrefillWorker

    return VLLMPrefillWorker(str(smollm2_dir), dtype="float32", chunk_tokens=256, kv_cache_gb=0.25,
                             max_model_len=4096)
