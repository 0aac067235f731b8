"""Block layout arithmetic, packing, and the arena allocator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasiskv.kvstore import BlockOutOfRange, InvalidArgument, KVLayout, StoreFull, pack_layer, pack_request
from oasiskv.kvstore.allocator import ExtentAllocator
from oasiskv.kvstore.config import CHUNK_ALIGN
from oasiskv.kvstore.layout import broadcast_units


def test_sizes_documented_in_layout():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    assert layout.unit_bytes == 2 * 16 * 64 * 2 == 4096
    assert layout.kv_bytes_per_block == 90 * 4096
    assert layout.summary_unit_bytes == 2 * 64 * 4
    assert layout.chunk_bytes % CHUNK_ALIGN == 0
    assert layout.chunk_bytes >= layout.kv_bytes_per_block + layout.summary_bytes_per_block
    assert layout.num_blocks(0) == 0 and layout.num_blocks(16) == 1 and layout.num_blocks(17) == 2
    assert KVLayout(28, 2, 128).unit_bytes == 8192  # Qwen2.5-1.5B


def test_unit_offsets_match_a_per_block_walk():
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    table = np.array([8192, 0, 40960], dtype=np.int64)  # blocks need not be in order
    expected = {}
    for block, chunk in enumerate(table):
        position = chunk
        for layer in range(3):
            for head in range(2):
                expected[(layer, head, block)] = position
                position += layout.unit_bytes
        for layer in range(3):
            for head in range(2):
                expected[("summary", layer, head, block)] = position
                position += layout.summary_unit_bytes
    keys = [k for k in expected if k[0] != "summary"]
    layers, heads, blocks = (np.array(v) for v in zip(*keys))
    assert layout.unit_offsets(table, layers, heads, blocks).tolist() == [expected[k] for k in keys]
    assert layout.summary_offsets(table, layers, heads, blocks).tolist() == [expected[("summary", *k)] for k in keys]


def test_check_units_names_the_bad_index():
    layout = KVLayout(2, 2, 8)
    with pytest.raises(BlockOutOfRange, match="kv_head index 5"):
        layout.check_units(np.array([0]), np.array([5]), np.array([0]), 4)
    with pytest.raises(BlockOutOfRange, match="block index -1"):
        layout.check_units(np.array([0]), np.array([0]), np.array([-1]), 4)


def test_layout_validation_and_wire_round_trip():
    layout = KVLayout(4, 2, 64, 16, torch.float16)
    assert KVLayout.from_wire(layout.to_wire()) == layout
    with pytest.raises(InvalidArgument):
        KVLayout(0, 2, 64)
    with pytest.raises(InvalidArgument):
        KVLayout(2, 2, 64, dtype=torch.int32)
    with pytest.raises(InvalidArgument):
        KVLayout.from_wire({"num_layers": 2})
    minmax = KVLayout(4, 2, 64, 16, torch.float16, summary_kind="minmax")
    assert KVLayout.from_wire(minmax.to_wire()) == minmax != layout  # the default is moments
    older = {key: value for key, value in layout.to_wire().items() if key != "summary_kind"}
    assert KVLayout.from_wire(older).summary_kind == "minmax"  # a peer from before the field existed
    with pytest.raises(InvalidArgument, match="summary kind"):
        KVLayout(4, 2, 64, summary_kind="median")


def test_broadcast_units():
    layers, heads, blocks = broadcast_units(1, [0, 1, 0], np.array([3, 4, 5]))
    assert layers.tolist() == [1, 1, 1] and heads.tolist() == [0, 1, 0] and blocks.tolist() == [3, 4, 5]
    with pytest.raises(InvalidArgument):
        broadcast_units([0, 1], [0, 1, 2], 0)
    with pytest.raises(InvalidArgument):
        broadcast_units(0.5, 0, 0)


def test_pack_layer_puts_k_and_v_of_each_block_together():
    tokens, heads, head_dim, block_size = 37, 2, 4, 16
    keys = torch.randn(tokens, heads, head_dim)
    values = torch.randn(tokens, heads, head_dim)
    packed = pack_layer(keys, values, block_size)
    assert packed.shape == (3, heads, 2, block_size, head_dim)
    for t in (0, 15, 16, 36):
        block, row = divmod(t, block_size)
        assert torch.equal(packed[block, :, 0, row], keys[t])
        assert torch.equal(packed[block, :, 1, row], values[t])
    assert packed[2, :, :, 5:].abs().sum() == 0  # padding
    request = pack_request(keys[None].repeat(2, 1, 1, 1), values[None].repeat(2, 1, 1, 1), block_size)
    assert request.shape == (2, 3, heads, 2, block_size, head_dim) and torch.equal(request[1], packed)


def test_allocator_carves_contiguous_runs_and_coalesces():
    alloc = ExtentAllocator(100 * 4096, 4096)
    a = alloc.allocate(10, 2 * 4096)
    assert np.array_equal(np.diff(a), np.full(9, 2 * 4096)) and a[0] == 0
    b = alloc.allocate(5, 4096)
    alloc.release(a[::2], 2 * 4096)  # holes
    assert alloc.num_extents == 6
    c = alloc.allocate(6, 4096)  # fits in the holes
    assert alloc.used_bytes == 5 * 8192 + 5 * 4096 + 6 * 4096
    alloc.release(a[1::2], 2 * 4096)
    alloc.release(b, 4096)
    alloc.release(c, 4096)
    assert alloc.used_bytes == 0 and alloc.num_extents == 1 and alloc.free_bytes == 100 * 4096


def test_allocator_refuses_with_needed_and_free_bytes():
    alloc = ExtentAllocator(10 * 4096, 4096)
    alloc.allocate(8, 4096)
    with pytest.raises(StoreFull) as info:
        alloc.allocate(3, 4096)
    assert info.value.needed_bytes == 3 * 4096 and info.value.free_bytes == 2 * 4096
    # Free space that exists only as holes too small for a chunk is reported as such.
    frag = ExtentAllocator(10 * 4096, 4096)
    chunks = frag.allocate(10, 4096)
    frag.release(chunks[::2], 4096)
    with pytest.raises(StoreFull, match="fragmented"):
        frag.allocate(1, 2 * 4096)


def test_allocator_detects_double_free():
    alloc = ExtentAllocator(10 * 4096, 4096)
    chunks = alloc.allocate(2, 4096)
    alloc.release(chunks[:1], 4096)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.release(chunks[:1], 4096)


def test_allocator_random_churn_keeps_accounting_exact():
    rng = np.random.default_rng(1)
    alloc = ExtentAllocator(1000 * 4096, 4096)
    live = []
    for _ in range(500):
        if live and rng.random() < 0.45:
            offsets, size = live.pop(rng.integers(len(live)))
            alloc.release(offsets, size)
        else:
            size = int(rng.integers(1, 5)) * 4096
            try:
                live.append((alloc.allocate(int(rng.integers(1, 20)), size), size))
            except StoreFull:
                pass
        ranges = sorted((int(o), int(o) + s) for offsets, s in live for o in offsets)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "overlapping chunks"
        assert alloc.used_bytes == sum(e - s for s, e in ranges)
    for offsets, size in live:
        alloc.release(offsets, size)
    assert alloc.num_extents == 1 and alloc.used_bytes == 0
