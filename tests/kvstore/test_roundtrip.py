"""Round trips through a store, the same suite over the inproc, tcp and nixl transports."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid

import numpy as np
import pytest
import torch

from oasiskv.kvstore import (
    SUMMARY_KINDS,
    KVLayout,
    KVStoreServer,
    UnknownRequest,
    connect,
    narrow_summaries,
    quantize_summaries,
    summarize_request,
)
from oasiskv.kvstore.layout import pack_layer

from .helpers import LAYOUT, random_request_blocks, random_request_kv, random_units


def rid(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_write_request_then_scattered_reads_are_bit_exact(client):
    request = rid()
    tokens = 150  # 10 blocks, the last one partial
    info = client.allocate(request, LAYOUT, tokens)
    assert info.num_blocks == 10 and info.nbytes == 10 * LAYOUT.chunk_bytes
    src = random_request_blocks(1, LAYOUT, tokens)
    client.write_request(request, src).wait()

    rng = np.random.default_rng(7)
    n = 200
    layers, heads, blocks = random_units(rng, LAYOUT, info.num_blocks, n)
    pool = torch.zeros(n + 17, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)  # larger than needed
    slots = rng.permutation(n + 17)[:n]
    handle = client.read_blocks(request, layers, heads, blocks, pool, slots)
    handle.wait()
    assert handle.done() and handle.num_units == n and handle.nbytes == n * LAYOUT.unit_bytes
    assert torch.equal(pool[slots], src[layers, blocks, heads])
    client.free(request)


def test_layer_by_layer_writes_and_per_layer_reads(client):
    request = rid()
    tokens = 64
    client.allocate(request, LAYOUT, tokens)
    keys, values = random_request_kv(2, LAYOUT, tokens)
    handles = [client.write_layer(request, layer, pack_layer(keys[layer], values[layer])) for layer in range(LAYOUT.num_layers)]
    for handle in handles:
        handle.wait()
    # The decode node's pattern: per layer, (kv_head, block) pairs into its own slots.
    pool = torch.zeros(8, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
    for layer in range(LAYOUT.num_layers):
        heads, blocks = [1, 0, 1], [3, 0, 2]
        client.read_blocks(request, layer, heads, blocks, pool, [5, 2, 7]).wait()
        expected = pack_layer(keys[layer], values[layer])
        for slot, head, block in zip([5, 2, 7], heads, blocks):
            assert torch.equal(pool[slot], expected[block, head])
    client.free(request)


@pytest.mark.parametrize("kind", SUMMARY_KINDS)
def test_summaries_computed_on_write_and_read_as_float32_or_bfloat16(client, kind):
    layout = dataclasses.replace(LAYOUT, summary_kind=kind)
    request = rid()
    tokens = 75
    client.allocate(request, layout, tokens)
    keys, values = random_request_kv(3, layout, tokens)
    client.write_request(request, random_request_blocks(3, layout, tokens)).wait()
    summaries = client.read_summaries(request)
    assert summaries.shape == (layout.num_layers, layout.num_kv_heads, 5, 2, layout.head_dim)
    # The kind travels with the layout over every transport; partial last block too.
    assert torch.equal(summaries, summarize_request(keys, layout.block_size, kind))
    assert torch.equal(client.read_summaries(request, first_block=2, num_blocks=2), summaries[:, :, 2:4])

    narrow = client.read_summaries(request, first_block=1, dtype="bfloat16")
    assert narrow.dtype == torch.bfloat16 and narrow.shape == summaries[:, :, 1:].shape
    assert torch.equal(narrow, narrow_summaries(summaries[:, :, 1:], torch.bfloat16))
    if kind == "minmax":  # the KV is bfloat16, so its min and max are bfloat16 numbers already: nothing is lost
        assert layout.dtype == torch.bfloat16 and torch.equal(narrow.float(), summaries[:, :, 1:])
    coded = client.read_summaries(request, first_block=1, dtype="uint8")  # codes with their ranges, every transport
    want = quantize_summaries(summaries[:, :, 1:])
    assert coded.codes.dtype == torch.uint8 and coded.shape == summaries[:, :, 1:].shape
    assert all(torch.equal(a, b) for a, b in ((coded.codes, want.codes), (coded.offset, want.offset), (coded.step, want.step)))
    client.free(request)


def test_decode_appends_blocks_and_their_summaries(client):
    request = rid()
    prompt = 40  # 3 blocks, last holds 8 tokens
    client.allocate(request, LAYOUT, prompt)
    keys, values = random_request_kv(4, LAYOUT, 80)
    client.write_request(request, pack_request_prefix(keys, values, prompt)).wait()
    unwritten = client.read_summaries(request)
    assert unwritten.shape[2] == 3

    # Decode fills the partial block, then a whole new one; each is written back when full.
    info = client.extend(request, 80)
    assert info.num_blocks == 5 and info.num_tokens == 80
    assert client.read_summaries(request, first_block=3).abs().sum() == 0  # fresh blocks score 0
    full = torch.stack([pack_layer(keys[l], values[l]) for l in range(LAYOUT.num_layers)])  # [L, 5, H, 2, bs, hd]
    for block in (2, 3, 4):
        units = full[:, block].reshape(-1, *LAYOUT.unit_shape)  # [L*H, 2, bs, hd]
        layers = np.repeat(np.arange(LAYOUT.num_layers), LAYOUT.num_kv_heads)
        heads = np.tile(np.arange(LAYOUT.num_kv_heads), LAYOUT.num_layers)
        client.write_blocks(request, layers, heads, block, units.contiguous()).wait()
    assert torch.equal(client.read_summaries(request), summarize_request(keys, LAYOUT.block_size))
    pool = torch.zeros(4, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
    client.read_blocks(request, 2, [0, 1, 0, 1], [3, 3, 4, 4], pool).wait()
    assert torch.equal(pool, full[2, [3, 3, 4, 4], [0, 1, 0, 1]])
    client.free(request)


def pack_request_prefix(keys: torch.Tensor, values: torch.Tensor, tokens: int) -> torch.Tensor:
    return torch.stack([pack_layer(k[:tokens], v[:tokens]) for k, v in zip(keys, values)])


def test_free_then_reuse_gives_memory_back(client):
    before = client.stats().used_bytes
    first = rid()
    client.allocate(first, LAYOUT, 300)
    used = client.stats().used_bytes
    assert used - before == LAYOUT.request_bytes(300)
    client.free(first)
    assert client.stats().used_bytes == before
    with pytest.raises(UnknownRequest):
        client.read_blocks(first, 0, 0, 0, torch.zeros(1, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)).wait()
    # The same id and the same memory serve a new request with new data.
    client.allocate(first, LAYOUT, 300)
    src = random_request_blocks(9, LAYOUT, 300)
    client.write_request(first, src).wait()
    out = torch.zeros_like(src)
    client.read_blocks(first, *np.indices(src.shape[:3]).reshape(3, -1)[[0, 2, 1]], out.view(-1, *LAYOUT.unit_shape)).wait()
    assert torch.equal(out, src)
    client.free(first)


def test_other_geometries_share_the_arena(client):
    layouts = [KVLayout(2, 1, 128, dtype=torch.float16), KVLayout(5, 4, 16, dtype=torch.float32)]
    requests = []
    for seed, layout in enumerate(layouts):
        request = rid()
        client.allocate(request, layout, 33)
        src = random_request_blocks(seed, layout, 33)
        client.write_request(request, src).wait()
        requests.append((request, layout, src))
    for request, layout, src in requests:
        out = torch.zeros_like(src)
        client.read_blocks(request, *np.indices(src.shape[:3]).reshape(3, -1)[[0, 2, 1]], out.view(-1, *layout.unit_shape)).wait()
        assert torch.equal(out, src)
        client.free(request)


def test_concurrent_writers_and_readers(server, client):
    """Four threads, each with its own client of this transport, write and read their own
    requests at once; a fifth keeps re-reading a shared request."""
    transport = client.transport_name
    shared = rid("shared")
    shared_src = random_request_blocks(100, LAYOUT, 128)
    client.allocate(shared, LAYOUT, 128)
    client.write_request(shared, shared_src).wait()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            with connect(server, transport=transport, timeout=10) as own:
                rng = np.random.default_rng(seed)
                for round_ in range(4):
                    request = rid(f"w{seed}")
                    tokens = int(rng.integers(16, 200))
                    info = own.allocate(request, LAYOUT, tokens)
                    src = random_request_blocks(seed * 100 + round_, LAYOUT, tokens)
                    own.write_request(request, src).wait()
                    layers, heads, blocks = random_units(rng, LAYOUT, info.num_blocks, 64)
                    out = torch.zeros(64, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
                    own.read_blocks(request, layers, heads, blocks, out).wait()
                    assert torch.equal(out, src[layers, blocks, heads])
                    own.free(request)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def shared_reader() -> None:
        try:
            with connect(server, transport=transport, timeout=10) as own:
                rng = np.random.default_rng(99)
                for _ in range(10):
                    layers, heads, blocks = random_units(rng, LAYOUT, 8, 32)
                    out = torch.zeros(32, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
                    own.read_blocks(shared, layers, heads, blocks, out).wait()
                    assert torch.equal(out, shared_src[layers, blocks, heads])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(1, 5)]
    threads.append(threading.Thread(target=shared_reader))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    client.free(shared)


def test_handles_can_be_polled_and_awaited(client):
    request = rid()
    client.allocate(request, LAYOUT, 64)
    src = random_request_blocks(5, LAYOUT, 64)
    client.write_request(request, src).wait()
    out = torch.zeros(6, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)

    async def fetch():
        await client.read_blocks(request, 1, [0, 1, 0], [0, 1, 3], out, [0, 1, 2])
        await client.read_blocks(request, 2, [1, 1, 0], [2, 2, 1], out, [3, 4, 5])

    asyncio.run(fetch())
    assert torch.equal(out[:3], src[1, [0, 1, 3], [0, 1, 0]])
    assert torch.equal(out[3:], src[2, [2, 2, 1], [1, 1, 0]])
    handle = client.read_blocks(request, 0, 0, 0, out)
    while not handle.done():
        pass
    assert torch.equal(out[0], src[0, 0, 0])
    client.free(request)


def test_empty_batches_are_no_ops(client):
    request = rid()
    client.allocate(request, LAYOUT, 16)
    out = torch.zeros(1, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
    client.read_blocks(request, [], [], [], out).wait()
    client.write_blocks(request, [], [], [], out).wait()
    client.free(request)


def test_metrics_count_traffic(server, client):
    request = rid()
    client.allocate(request, LAYOUT, 32)
    client.write_request(request, random_request_blocks(6, LAYOUT, 32)).wait()
    out = torch.zeros(10, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
    client.read_blocks(request, 0, 0, [0, 1, 0, 1, 0, 1, 0, 1, 0, 1], out).wait()
    client.free(request)
    transport = client.transport_name

    def value(name: str) -> float:
        return server.metrics.registry.get_sample_value(name, {"transport": transport}) or 0.0

    # NIXL reads are counted when the store sees the transfer's notification.
    deadline = 50
    while value("oasiskv_kvstore_blocks_read_total") < 10 and deadline:
        threading.Event().wait(0.02)
        deadline -= 1
    assert value("oasiskv_kvstore_blocks_read_total") >= 10
    assert value("oasiskv_kvstore_bytes_served_total") >= 10 * LAYOUT.unit_bytes
    assert value("oasiskv_kvstore_blocks_written_total") >= 12
    text = client.metrics_text()
    for name in ("oasiskv_kvstore_used_bytes", "oasiskv_kvstore_free_bytes", "oasiskv_kvstore_requests",
                 "oasiskv_kvstore_blocks_read_total", "oasiskv_kvstore_bytes_served_total", "oasiskv_kvstore_errors_total"):
        assert name in text
    assert ":" not in "".join(line.split(" ")[0].split("{")[0] for line in text.splitlines() if not line.startswith("#"))


def test_auto_transport_choice(server):
    with connect(server) as local:
        assert local.transport_name == "inproc"
    with connect(server.address) as remote:
        assert remote.transport_name == ("nixl" if server.serves_nixl else "tcp")
    tcp_only = KVStoreServer(capacity_bytes=4 << 20, prefault=False, transport="tcp")
    tcp_only.start()
    try:
        with connect(tcp_only.address) as remote:
            assert remote.transport_name == "tcp"
    finally:
        tcp_only.stop()


def test_unregistered_buffers_are_registered_per_transfer_only(client):
    request = rid()
    client.allocate(request, LAYOUT, 32)
    client.write_request(request, random_request_blocks(8, LAYOUT, 32)).wait()
    pool = torch.zeros(4, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
    client.register(pool)
    for _ in range(20):  # e.g. a prefill node writing `.cpu()` copies layer by layer
        client.read_blocks(request, 0, 0, [0, 1], torch.zeros(2, *LAYOUT.unit_shape, dtype=LAYOUT.dtype)).wait()
        client.read_blocks(request, 1, 1, [0, 1], pool).wait()
    if client.transport_name == "nixl":
        regions = client.transport.initiator._regions
        assert len(regions) == 1 and regions[0][2] is pool
    client.unregister(pool)
    client.free(request)
