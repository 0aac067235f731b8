"""Helpers shared by the KV store tests (data that can be regenerated from a seed in another
process, and store processes started through the real command line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import numpy as np
import torch

from oasiskv.kvstore import KVLayout, pack_request

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_request_kv(seed: int, layout: KVLayout, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per seed, so another process can regenerate what it should read."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)
    keys = torch.randn(shape, generator=g).to(layout.dtype)
    values = torch.randn(shape, generator=g).to(layout.dtype)
    return keys, values


def random_request_blocks(seed: int, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    keys, values = random_request_kv(seed, layout, num_tokens)
    return pack_request(keys, values, layout.block_size)


def random_units(rng: np.random.Generator, layout: KVLayout, num_blocks: int, n: int):
    return (
        rng.integers(0, layout.num_layers, n),
        rng.integers(0, layout.num_kv_heads, n),
        rng.integers(0, num_blocks, n),
    )


@contextmanager
def store_process(*extra_args: str, port: int = 0, capacity_gb: float = 0.0625):
    """A store started with `python -m oasiskv.cluster.cli kvstore`, killed on exit."""
    cmd = [sys.executable, "-m", "oasiskv.cluster.cli", "kvstore", "--port", str(port),
           "--capacity-gb", str(capacity_gb), "--no-prefault", *extra_args]
    # stderr to a file: a pipe nobody reads could fill up and stall the store.
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        address = _wait_ready(proc, errors, timeout=60)
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        proc.stdout.close()
        errors.close()


def _wait_ready(proc: subprocess.Popen, errors, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            errors.seek(0)
            raise RuntimeError(f"store exited (rc={proc.returncode}): {errors.read()[-2000:]}")
        if line.startswith("READY "):
            return line.split()[1]
    raise RuntimeError("store did not become ready")
