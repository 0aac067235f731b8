"""Key summaries paged into the device pool: what is written is what is read back (across page
boundaries, rows that are not adjacent, a rewritten partial block), the selection ranks from the
pages exactly as from a tensor, and admission counts the pages: a request waits, or is refused,
when its KV rows and its pages together do not fit."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.decode_node.lookahead import Selection, select_blocks_batched
from oasiskv.decode_node.summary_pages import PagedLayer, SummaryPages
from oasiskv.decode_node.working_set import DevicePool, plan_rows, summary_blocks_per_row
from oasiskv.kvstore import KVLayout, KVStore, connect, narrow_summaries, quantize_summaries, summarize_request
from oasiskv.models.attention import AttentionBuffers
from oasiskv.models.engine.scheduler import RequestTooLarge
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller, kv_layout_for

from ..conftest import stdlib_source

LAYERS, HEADS, DIM = 3, 2, 8


def _pool(kv_dtype=torch.bfloat16, summary_dtype=torch.bfloat16, rows=8, device="cpu") -> DevicePool:
    layout = KVLayout(LAYERS, HEADS, DIM, 16, kv_dtype)
    row_bytes = LAYERS * HEADS * layout.unit_bytes
    return DevicePool(layout, rows * row_bytes, device, summary_dtype)


def test_a_pool_too_small_for_one_row_names_kv_pool_gb():
    layout = KVLayout(LAYERS, HEADS, DIM, 16, torch.bfloat16)
    row_bytes = LAYERS * HEADS * layout.unit_bytes
    DevicePool(layout, row_bytes)  # one row: enough to start
    with pytest.raises(ValueError, match=rf"kv_pool_gb: .* holds no row .*\({row_bytes} bytes each"):
        DevicePool(layout, row_bytes - 1)


def _summaries(blocks: int, seed: int = 0) -> torch.Tensor:
    keys = torch.randn(LAYERS, blocks * 16, HEADS, DIM, generator=torch.Generator().manual_seed(seed))
    return summarize_request(keys)  # [layers, heads, blocks, 2, d] float32


@pytest.mark.parametrize("kv_dtype,summary_dtype,per_page", [
    (torch.bfloat16, torch.bfloat16, 16), (torch.float32, torch.bfloat16, 32), (torch.bfloat16, torch.float32, 8),
])
def test_what_is_written_is_read_back_across_pages(kv_dtype, summary_dtype, per_page):
    pool = _pool(kv_dtype, summary_dtype)
    assert pool.summary_blocks == per_page
    rows = torch.tensor([5, 1, 3])  # not adjacent, not in order
    pages = SummaryPages(pool, rows)
    blocks = 2 * per_page + 3
    summaries = _summaries(blocks)
    pages.write(0, summaries)
    expected = narrow_summaries(summaries, summary_dtype)  # as the store narrows them for a read
    assert pages.num_blocks == blocks and torch.equal(pages.blocks(), expected)
    buffers = AttentionBuffers()
    for layer, first, end in [(0, 0, blocks), (1, per_page - 2, per_page + 5), (2, 3, 3), (2, per_page, 2 * per_page)]:
        got = pages.candidates(layer, first, end, buffers)
        want = expected[layer, :, first:end].float().reshape(HEADS, end - first, 2 * DIM)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    # Only the request's own rows were written: every other row of the pool is still zero.
    others = [r for r in range(pool.num_rows) if r not in rows.tolist()]
    assert not pool.tensor[others].any()


def test_a_rewritten_partial_block_replaces_the_last_one():
    pages = SummaryPages(_pool(), torch.tensor([0, 2]))
    first, second = _summaries(20, seed=1), _summaries(3, seed=2)
    pages.write(0, first)
    pages.write(19, second)  # block 19 was partly filled; it is now complete, and two follow
    assert pages.num_blocks == 22
    held = pages.blocks()
    assert torch.equal(held[:, :, :19], narrow_summaries(first[:, :, :19], torch.bfloat16))
    assert torch.equal(held[:, :, 19:], narrow_summaries(second, torch.bfloat16))


def test_bad_writes_and_reads_are_refused():
    pages = SummaryPages(_pool(), torch.tensor([4]))  # 16 blocks
    pages.write(0, _summaries(4))
    with pytest.raises(ValueError, match="do not follow"):
        pages.write(6, _summaries(1))  # a gap
    with pytest.raises(ValueError, match="do not follow"):
        pages.write(4, _summaries(13))  # past the capacity
    with pytest.raises(ValueError, match="summarized"):
        pages.candidates(0, 2, 5)
    assert pages.num_blocks == 4
    empty = SummaryPages(_pool(), torch.tensor([5]))
    empty.write(0, _summaries(0))  # a prompt shorter than one block has no summary yet
    assert empty.num_blocks == 0 and empty.blocks().shape == (LAYERS, HEADS, 0, 2, DIM)


def test_selection_from_pages_equals_selection_from_the_tensor():
    pool = _pool(rows=20)
    generator = torch.Generator().manual_seed(3)
    paged, plain = [], []
    for i, (blocks, first, end, k, rows) in enumerate([(40, 1, 35, 8, 3), (70, 1, 66, 16, 1), (12, 1, 5, 8, 3)]):
        pages = SummaryPages(pool, torch.arange(i, 20, 4))  # 5 pages, interleaved with the others'
        summaries = _summaries(blocks, seed=10 + i)
        pages.write(0, summaries)
        queries = torch.randn(rows, 4 * HEADS, DIM, generator=generator)
        layer = i % LAYERS
        widened = narrow_summaries(summaries, torch.bfloat16)[layer].float()
        plain.append(Selection(queries, widened, first, end, k, 0.5))
        paged.append(Selection(queries, PagedLayer(pages, layer, AttentionBuffers()), first, end, k, 0.5))
    for got, want in zip(select_blocks_batched(paged, 0.35), select_blocks_batched(plain, 0.35)):
        assert (got == want).all()


@pytest.mark.cuda
def test_pages_on_cuda_hold_and_give_what_the_cpu_pages_do():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    summaries = _summaries(40, seed=4)
    held = []
    for device in ("cpu", "cuda"):
        pages = SummaryPages(_pool(device=device), torch.tensor([6, 2, 4]))
        pages.write(0, summaries.to(device))
        assert pages.pool.summary_units.device.type == device
        held.append((pages.blocks().cpu(), pages.candidates(1, 3, 37, AttentionBuffers()).cpu()))
    assert torch.equal(held[0][0], held[1][0]) and torch.equal(held[0][1], held[1][1])


def test_plan_rows_counts_the_pages_every_block_the_request_can_reach_needs():
    config = DecodeConfig(budget_tokens=256, summary_read_dtype="bfloat16")
    plan = plan_rows(config, 1000, 100, kv_itemsize=2)
    blocks = -(-(1000 + 100 + config.num_draft_tokens + 1) // 16)  # 69
    assert plan.kv_rows == 1 + 5 + 16 and plan.summary_pages == -(-blocks // 16) == 5
    assert plan.total == plan.kv_rows + plan.summary_pages
    assert plan_rows(config, 1000, 100, kv_itemsize=4).summary_pages == 3  # fp32 KV rows hold 32 blocks' bf16 summaries
    assert plan_rows(DecodeConfig(summary_read_dtype="float32"), 1000, 100, kv_itemsize=2).summary_pages == 9
    assert plan_rows(DecodeConfig(), 1000, 100, kv_itemsize=2).summary_pages == 3  # uint8 codes (the default): 32 a row
    assert plan_rows(config, 1000, 100, "dense", kv_itemsize=2).summary_pages == 0
    with pytest.raises(ValueError, match="even block_size"):
        summary_blocks_per_row(15, 2, 4)


def test_plan_rows_gives_a_short_request_no_more_budget_rows_than_blocks_it_can_reach():
    config = DecodeConfig()  # a 2,048-token budget: 128 rows
    for mode in ("lookahead", "sparse-current"):
        short = plan_rows(config, 10, 40, mode, kv_itemsize=2)  # 54 tokens: 4 blocks, 1 of them the sink
        assert (short.sinks, short.budget, short.total) == (1, 3, 1 + 5 + 3 + 1)
    assert plan_rows(config, 8, 4, "lookahead", kv_itemsize=2).budget == 0  # 16 tokens with the drafts: one block, the sink
    assert plan_rows(config, 3000, 100, "lookahead", kv_itemsize=2).budget == 128
    assert plan_rows(config, 10, 40, "lookahead", budget_tokens=32, kv_itemsize=2).budget == 2


@pytest.fixture(scope="module")
def store():
    return KVStore(64 * 2**20)


def test_admission_counts_the_summary_pages(smollm2_llm, store):
    """A pool that holds one request's KV rows and pages holds one request at a time: the second
    waits (it is not admitted on its KV rows alone); a pool one row smaller refuses it."""
    model, tokenizer = smollm2_llm.model, smollm2_llm.tokenizer
    ids = smollm2_llm.encode(stdlib_source("argparse.py"))
    prompts = [ids[:640], ids[1000:1600]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = DecodeConfig(budget_tokens=160, kv_pool_gb=1.0)
    layout = kv_layout_for(model, config.block_size)
    plan = plan_rows(config, len(prompts[0]), params.max_tokens, kv_itemsize=layout.itemsize)
    assert plan.summary_pages >= 1
    row_bytes = layout.units_per_block * layout.unit_bytes
    client = connect(store)
    prefiller = Prefiller(model, client)
    results = [prefiller.prefill(f"pages-{i}", p, params, budget_blocks=config.budget_blocks,
                                 excluded_head_blocks=config.sink_blocks, excluded_tail_blocks=config.window_blocks)
               for i, p in enumerate(prompts)]

    too_small = config.model_copy(update={"kv_pool_gb": (plan.total - 0.5) * row_bytes / 2**30})
    engine = DecodeEngine(model, tokenizer, client, too_small)
    assert engine.pool.num_rows == plan.total - 1 >= plan.kv_rows
    with pytest.raises(RequestTooLarge, match="device KV pool"):
        engine.add(results[0], params)
    engine.close()

    one_at_a_time = config.model_copy(update={"kv_pool_gb": (plan.total + 0.5) * row_bytes / 2**30})
    engine = DecodeEngine(model, tokenizer, client, one_at_a_time)
    for result in results:
        engine.add(result, params)
    finished, most_running = {}, 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        most_running = max(most_running, len(engine.running))
        assert engine.pool.rows_used <= engine.pool.num_rows
    assert most_running == 1 and sorted(finished) == ["pages-0", "pages-1"]
    assert all(len(out.token_ids) == params.max_tokens for out in finished.values())
    assert engine.pool.rows_used == 0
    engine.close()
    assert store.stats().num_requests == 0


def test_uint8_pages_hold_the_codes_and_rank_as_the_values_do():
    pool = _pool(summary_dtype=torch.uint8, rows=20)
    assert pool.summary_blocks == 32  # a bf16 KV row holds twice the blocks of bf16 summaries
    generator = torch.Generator().manual_seed(7)
    paged, plain = [], []
    for i, (blocks, first, end, k) in enumerate([(40, 1, 35, 8), (70, 1, 66, 16), (12, 1, 5, 8)]):
        pages = SummaryPages(pool, torch.arange(i, 20, 4)[:3])
        coded = quantize_summaries(_summaries(blocks, seed=20 + i))  # as the store sends them
        pages.write(0, coded)
        assert torch.equal(pages.blocks(), coded.codes) and torch.equal(pages.dequantized(), coded.dequantize())
        layer = i % LAYERS
        got = pages.candidates(layer, first, end, AttentionBuffers())
        assert torch.equal(got, coded.codes[layer, :, first:end].float().reshape(HEADS, end - first, 2 * DIM))
        queries = torch.randn(3, 4 * HEADS, DIM, generator=generator)
        plain.append(Selection(queries, coded.dequantize()[layer], first, end, k, 0.5))
        paged.append(Selection(queries, PagedLayer(pages, layer, AttentionBuffers()), first, end, k, 0.5))
    for got, want in zip(select_blocks_batched(paged, 0.35), select_blocks_batched(plain, 0.35)):
        assert (got == want).all()
    with pytest.raises(ValueError, match="uint8 summary codes"):
        SummaryPages(_pool(), torch.tensor([0])).write(0, quantize_summaries(_summaries(2)))


def test_uint8_pages_widen_a_range_a_written_back_block_leaves():
    pages = SummaryPages(_pool(summary_dtype=torch.uint8), torch.tensor([3, 0]))
    prompt = _summaries(20, seed=30)
    pages.write(0, quantize_summaries(prompt))
    offset, step = pages.offset.clone(), pages.step.clone()
    inside = prompt[:, :, 5:6].clone()
    pages.write(20, inside)  # within every range: nothing moves
    assert torch.equal(pages.offset, offset) and torch.equal(pages.step, step)
    outside = prompt[:, :, 6:7].clone()
    outside[1, 0, 0, 1, 3] = prompt[1, 0, :, 1, 3].max() + 5.0  # one channel of one block beyond its range
    pages.write(21, outside)
    changed = pages.step != step
    assert changed.sum() == 1 and changed[1, 0, 1, 3] and (pages.offset == offset).all()
    assert pages.offset[1, 0, 1, 3] + 255 * pages.step[1, 0, 1, 3] > outside[1, 0, 0, 1, 3]  # with room to spare
    held, exact = pages.dequantized(), torch.cat((prompt, inside, outside), dim=2)
    assert (held[..., 0, :] <= exact[..., 0, :] + 1e-6).all() and (held[..., 1, :] >= exact[..., 1, :] - 1e-6).all()
    assert ((held - exact).abs() <= 2 * pages.step.unsqueeze(2) + 1e-6).all()  # recoded once: a step more
    unchanged = ~changed.unsqueeze(2).expand_as(held)
    assert torch.equal(held[:, :, :20][unchanged[:, :, :20]], quantize_summaries(prompt).dequantize()[unchanged[:, :, :20]])
