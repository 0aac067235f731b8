"""The store as a Ray actor, read by another actor over NIXL (or TCP without NIXL)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasiskv.kvstore import connect, launch_store_actor
from oasiskv.kvstore.nixl_transport import nixl_available

from .helpers import LAYOUT, random_request_blocks

ray = pytest.importorskip("ray")
TRANSPORT = "nixl" if nixl_available() else "tcp"


class Reader:
    def read(self, address: str, transport: str, request_id: str, layers, heads, blocks) -> bytes:
        with connect(address, transport=transport, timeout=20) as client:
            out = torch.zeros(len(layers), *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
            client.read_blocks(request_id, layers, heads, blocks, out).wait()
            return out.view(torch.uint8).numpy().tobytes()


def test_store_actor_serves_another_actor():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    store = None
    try:
        store, address = launch_store_actor({"capacity_bytes": 32 << 20, "prefault": False})
        with connect(address, transport=TRANSPORT, timeout=20) as client:
            client.allocate("ray-req", LAYOUT, 100)
            src = random_request_blocks(5, LAYOUT, 100)
            client.write_request("ray-req", src).wait()
            rng = np.random.default_rng(0)
            layers, heads, blocks = (rng.integers(0, b, 50).tolist() for b in (LAYOUT.num_layers, LAYOUT.num_kv_heads, 7))
            reader = ray.remote(Reader).options(num_cpus=0).remote()
            data = ray.get(reader.read.remote(address, TRANSPORT, "ray-req", layers, heads, blocks), timeout=60)
            got = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(LAYOUT.dtype).view(50, *LAYOUT.unit_shape)
            assert torch.equal(got, src[layers, blocks, heads])
            client.free("ray-req")
        stats = ray.get(store.stats.remote(), timeout=30)
        assert stats["used_bytes"] == 0 and stats["nixl"] == nixl_available()
        assert "oasiskv_kvstore_blocks_read_total" in ray.get(store.metrics_text.remote(), timeout=30)
        ray.get(store.shutdown.remote(), timeout=30)
    finally:
        if store is not None:
            ray.kill(store)
        ray.shutdown()
