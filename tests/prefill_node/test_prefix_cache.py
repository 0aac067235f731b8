"""The prefill worker's prefix cache: what it hands back, what it keeps, and that a prompt
prefilled from it writes the KV, summaries and first token of one computed from token 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasiskv.kvstore import KVStoreServer, connect
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller
from oasiskv.prefill_node.prefix_cache import PrefixCache

from ..conftest import stdlib_source

LAYERS, HEADS, DIM, BLOCK = 2, 3, 4, 16
PER_BLOCK = 2 * LAYERS * HEADS * BLOCK * DIM * 4  # K and V in fp32


def kv_for(prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """KV as a paged prefill cache holds it ([kv_heads, slots, head_dim] a layer), each token's
    entries a function of its position and id, so a wrong block shows."""
    slots = len(prompt) + 5  # a cache is whole blocks, longer than the prompt
    ids = torch.tensor(prompt + [0] * 5, dtype=torch.float32)
    keys = [ids.view(1, -1, 1).expand(HEADS, slots, DIM) * (layer + 1) + torch.arange(slots).view(1, -1, 1) * 1e-3
            for layer in range(LAYERS)]
    return keys, [-k for k in keys]


def test_a_prompt_comes_back_in_whole_blocks_leaving_its_last_token_to_compute():
    cache = PrefixCache(64 * PER_BLOCK, BLOCK)
    prompt = list(range(100, 150))  # 3 whole blocks and 2 tokens
    keys, values = kv_for(prompt)
    assert cache.insert(prompt, keys, values) == 3
    assert cache.used_bytes == 3 * PER_BLOCK

    hit = cache.lookup(prompt + [7, 8, 9])
    assert hit.tokens == 48
    for layer in range(LAYERS):
        assert torch.equal(hit.layer(layer)[0], keys[layer][:, :48])
        assert torch.equal(hit.layer(layer)[1], values[layer][:, :48])
    # A prompt of exactly 3 blocks gets 2: its last row's logits give the first token.
    assert cache.lookup(prompt[:48]).tokens == 32
    assert cache.lookup(prompt[:17]).tokens == 16
    assert cache.lookup(prompt[:16]).tokens == 0
    # Inserting the same prompt again adds nothing.
    assert cache.insert(prompt, keys, values) == 0 and cache.num_blocks == 3


def test_a_prompt_that_parts_from_a_cached_one_gets_only_the_blocks_before_it_parts():
    cache = PrefixCache(64 * PER_BLOCK, BLOCK)
    first = list(range(64))
    cache.insert(first, *kv_for(first))
    second = first[:20] + [999] + first[21:]  # parts inside block 1
    assert cache.lookup(second).tokens == 16
    # Its own blocks join the shared first one: 1 + 3 more.
    assert cache.insert(second, *kv_for(second)) == 3
    assert cache.num_blocks == 7
    hit = cache.lookup(second + [1])
    assert hit.tokens == 64 and torch.equal(hit.layer(0)[0], kv_for(second)[0][0][:, :64])
    # The same tokens at another place in the prompt are another block.
    assert cache.lookup(first[16:32] + first[:16] + [1]).tokens == 0


class Colliding(PrefixCache):
    """Every prompt whose first token is 0 or 500 has its first block under one key."""

    @staticmethod
    def _key(parent, tokens):
        return b"collision" if parent == b"" and tokens[0] in (0, 500) else PrefixCache._key(parent, tokens)


def test_a_hash_collision_is_a_miss_never_another_prompts_kv():
    cache = Colliding(64 * PER_BLOCK, BLOCK)
    first, second = list(range(40)), list(range(500, 540))
    cache.insert(first, *kv_for(first))
    assert cache.lookup(second).tokens == 0
    assert cache.insert(second, *kv_for(second)) == 2  # takes the key over
    assert cache.lookup(first).tokens == 0
    hit = cache.lookup(second)
    assert hit.tokens == 32 and torch.equal(hit.layer(0)[0], kv_for(second)[0][0][:, :32])
    assert cache.used_bytes == cache.num_blocks * PER_BLOCK == 3 * PER_BLOCK  # the block taken over is not counted


def test_a_block_whose_parent_was_taken_over_by_a_collision_is_not_served():
    """Prompts that differ only in a colliding first block have the same key for their second:
    the second block found must be the child of the first block found, not of the one it replaced."""
    cache = Colliding(64 * PER_BLOCK, BLOCK)
    shared = list(range(1000, 1016))
    victim = list(range(16)) + shared + [7]
    attacker = list(range(500, 516)) + [7]
    cache.insert(victim, *kv_for(victim))
    cache.insert(attacker, *kv_for(attacker))  # one whole block: it takes the first key over
    assert cache.lookup(victim).tokens == 0
    # The attacker's first block, then the victim's second block by key: computed after other tokens.
    assert cache.lookup(list(range(500, 516)) + shared + [7]).tokens == 16


def test_least_recently_used_blocks_go_first_and_a_prefix_outlives_its_extensions():
    cache = PrefixCache(4 * PER_BLOCK, BLOCK)
    first, second = list(range(48)), list(range(1000, 1048))
    cache.insert(first, *kv_for(first))
    assert cache.insert(second, *kv_for(second)) == 3
    assert cache.used_bytes == 4 * PER_BLOCK
    # Room for 3 more was made from the first prompt's last two blocks, not its first.
    assert cache.lookup(first + [1]).tokens == 16
    assert cache.lookup(second + [1]).tokens == 48
    # Looked up just now, the first prompt's block is kept over the second's last one.
    third = list(range(2000, 2016))
    cache.lookup(first + [1])
    assert cache.insert(third, *kv_for(third)) == 1
    assert cache.lookup(first + [1]).tokens == 16
    assert cache.lookup(second + [1]).tokens == 32


def test_an_insert_that_fails_midway_leaves_no_block_to_find():
    """Blocks were registered before their KV was copied in: a copy that failed (out of memory on
    the way from a GPU, say) left them pointing at another prompt's KV."""
    cache = PrefixCache(4 * PER_BLOCK, BLOCK)
    first, second = list(range(48)), list(range(100, 148))
    cache.insert(first, *kv_for(first))
    keys, values = kv_for(second)
    values[-1] = values[-1][:, :40]  # the last layer's V cannot be split into the three blocks
    with pytest.raises(RuntimeError):
        cache.insert(second, keys, values)
    assert cache.lookup(second + [1]).tokens == 0
    assert cache.num_blocks + len(cache._free_slots) == 4  # no slot lost
    cache.insert(second, *kv_for(second))
    hit = cache.lookup(second + [1])
    assert hit.tokens == 48 and torch.equal(hit.layer(LAYERS - 1)[1], kv_for(second)[1][-1][:, :48])


def test_a_prompt_larger_than_the_cache_keeps_the_beginning_that_fits():
    cache = PrefixCache(2 * PER_BLOCK + PER_BLOCK // 2, BLOCK)
    prompt = list(range(80))
    assert cache.insert(prompt, *kv_for(prompt)) == 2
    assert cache.used_bytes == 2 * PER_BLOCK <= cache.capacity_bytes
    assert cache.lookup(prompt).tokens == 32


def test_a_cache_of_no_bytes_keeps_nothing_and_bad_sizes_are_named():
    cache = PrefixCache(0, BLOCK)
    prompt = list(range(40))
    assert cache.insert(prompt, *kv_for(prompt)) == 0
    assert cache.lookup(prompt).tokens == 0 and cache.num_blocks == 0
    assert PrefixCache(PER_BLOCK - 1, BLOCK).insert(prompt, *kv_for(prompt)) == 0  # not one block fits
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(-1, BLOCK)
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(1024, 0)


# --- against a real model and store ---------------------------------------------------------


def stored_kv(client, request_id: str, layout, num_tokens: int) -> torch.Tensor:
    """Every unit the store holds for a request: [layers, kv_heads, blocks, 2, block_size, head_dim]."""
    blocks = layout.num_blocks(num_tokens)
    layers, heads, index = np.meshgrid(np.arange(layout.num_layers), np.arange(layout.num_kv_heads), np.arange(blocks),
                                       indexing="ij")
    out = torch.empty((layers.size, *layout.unit_shape), dtype=layout.dtype)
    client.read_blocks(request_id, layers.ravel(), heads.ravel(), index.ravel(), out).wait()
    return out.view(layout.num_layers, layout.num_kv_heads, blocks, *layout.unit_shape)


def test_a_prompt_prefilled_from_the_cache_writes_what_a_full_prefill_writes(smollm2_llm, store):
    """A chat's next turn: the earlier prompt's blocks come from the cache; the store gets the
    same KV and summaries, the decode node the same first token and working set."""
    text = smollm2_llm.encode(stdlib_source("argparse.py"))
    earlier, later = text[:700], text[:1000]
    client = connect(store.address, transport="tcp")
    cache = PrefixCache(64 * 2**20, 16)
    cached = Prefiller(smollm2_llm.model, client, chunk_tokens=256, prefix_cache=cache)
    full = Prefiller(smollm2_llm.model, client, chunk_tokens=256)
    params = SamplingParams(max_tokens=8, logprobs=3)

    first = cached.prefill("turn-1", earlier, params)
    assert first.cached_tokens == 0
    client.free("turn-1")
    assert cache.num_blocks == 700 // 16

    reused = cached.prefill("turn-2", later, params)
    recomputed = full.prefill("turn-2-full", later, params)
    try:
        assert reused.cached_tokens == 688 and recomputed.cached_tokens == 0
        assert reused.first_token == recomputed.first_token
        assert reused.first_logprob.logprob == pytest.approx(recomputed.first_logprob.logprob, abs=1e-4)
        ours, theirs = (stored_kv(client, rid, reused.layout, len(later)) for rid in ("turn-2", "turn-2-full"))
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
        assert not torch.equal(ours[:, :, 50], torch.zeros_like(ours[:, :, 50]))  # the computed part is there too
        torch.testing.assert_close(client.read_summaries("turn-2"), client.read_summaries("turn-2-full"),
                                   atol=2e-4, rtol=1e-4)
        same = (reused.initial_selection == recomputed.initial_selection).float().mean().item()
        assert same > 0.95  # near-ties may swap a block; the sets are the same up to them
    finally:
        client.free("turn-2")
        client.free("turn-2-full")
    assert cache.num_blocks == 1000 // 16  # the later prompt's blocks joined the earlier ones


def test_the_same_prompt_again_computes_only_its_last_block(smollm2_llm, store):
    """The other choices of an n > 1 request: the same prompt, prefilled once."""
    prompt = smollm2_llm.encode(stdlib_source("textwrap.py"))[:520]
    client = connect(store.address, transport="tcp")
    prefiller = Prefiller(smollm2_llm.model, client, chunk_tokens=256, prefix_cache=PrefixCache(64 * 2**20, 16))
    once = prefiller.prefill("choice-0", prompt)
    again = prefiller.prefill("choice-1", prompt)
    try:
        assert (once.cached_tokens, again.cached_tokens) == (0, 512)
        assert once.first_token == again.first_token
        torch.testing.assert_close(stored_kv(client, "choice-1", again.layout, len(prompt)),
                                   stored_kv(client, "choice-0", once.layout, len(prompt)), atol=2e-4, rtol=1e-4)
    finally:
        client.free("choice-0")
        client.free("choice-1")
    assert store.store.stats().num_requests == 0


def test_a_prefix_cache_the_workers_memory_cannot_hold_is_refused_at_start():
    from oasiskv.prefill_node.worker import _check_prefix_cache_fits, _memory_limit_bytes

    limit = _memory_limit_bytes()
    assert limit is not None and limit > 2**30
    _check_prefix_cache_fits(0)
    _check_prefix_cache_fits(0.5, model_bytes=2**28, block_bytes=2**20)
    with pytest.raises(ValueError, match=r"--prefix-cache-gb .* does not fit this prefill worker's memory"):
        _check_prefix_cache_fits(limit / 2**30)
    # With the model loaded, its weights count too.
    with pytest.raises(ValueError, match=r"beside its model's"):
        _check_prefix_cache_fits((limit - 2**29) / 2**30, model_bytes=2**30)
    with pytest.raises(ValueError, match="holds not one block"):
        _check_prefix_cache_fits(1e-9, block_bytes=2**20)
    _check_prefix_cache_fits(0, block_bytes=2**20)  # off


def test_a_prefill_worker_shares_its_cache_between_stores(store):
    """One cache for every store a worker writes to: a prompt's KV is the same in each."""
    from oasiskv.prefill_node.worker import PrefillWorker

    other = KVStoreServer(capacity_bytes=64 * 2**20, prefault=False, transport="tcp")
    other.start()
    try:
        worker = PrefillWorker("smollm2-135m", chunk_tokens=256, transport="tcp", prefix_cache_gb=0.05)
        prompt = worker.tokenizer.encode(stdlib_source("textwrap.py"))[:300]
        args = ({"max_tokens": 4}, 16, 1, 4)
        first = worker.prefill("in-one", prompt, args[0], store.address, *args[1:])
        second = worker.prefill("in-other", prompt, args[0], other.address, *args[1:])
        assert (first.cached_tokens, second.cached_tokens) == (0, 288)
        assert first.first_token == second.first_token
        worker.free("in-one", store.address)
        worker.free("in-other", other.address)
        assert store.store.stats().num_requests == other.store.stats().num_requests == 0
    finally:
        other.stop()
