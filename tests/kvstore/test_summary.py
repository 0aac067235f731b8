"""Key summaries and the block score upper bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv.kvstore import (
    InvalidArgument,
    block_scores,
    narrow_summaries,
    quantize_summaries,
    rank_blocks,
    summarize_keys,
    summarize_layer,
    summarize_request,
)
from oasiskv.kvstore.summary import block_scores_reference, fits_range, query_weights, softmax_shares


def test_summaries_are_min_and_max_over_real_tokens():
    keys = torch.randn(37, 2, 8)  # 3 blocks, the last with 5 tokens
    summaries = summarize_layer(keys, block_size=16, kind="minmax")
    assert summaries.shape == (2, 3, 2, 8) and summaries.dtype == torch.float32
    for head in range(2):
        for block in range(3):
            rows = keys[block * 16:(block + 1) * 16, head]
            assert torch.equal(summaries[head, block, 0], rows.amin(0))
            assert torch.equal(summaries[head, block, 1], rows.amax(0))
    request = summarize_request(torch.stack([keys, -keys]), kind="minmax")
    assert request.shape == (2, 2, 3, 2, 8) and torch.equal(request[0], summaries)


def test_summarize_keys_masks_padding_rows():
    block = torch.full((16, 4), 100.0)
    block[:3] = torch.arange(12.0).view(3, 4)
    out = summarize_keys(block, valid_tokens=3, kind="minmax")
    assert torch.equal(out[0], block[:3].amin(0)) and torch.equal(out[1], block[:3].amax(0))


def test_moment_summaries_are_mean_minus_and_plus_std_over_real_tokens():
    keys = torch.randn(37, 2, 8) * 3 + 1  # 3 blocks, the last with 5 tokens
    summaries = summarize_layer(keys, block_size=16, kind="moments")
    assert summaries.shape == (2, 3, 2, 8) and summaries.dtype == torch.float32
    for head in range(2):
        for block in range(3):
            rows = keys[block * 16:(block + 1) * 16, head]
            mean, std = rows.mean(0), rows.std(0, unbiased=False)
            torch.testing.assert_close(summaries[head, block, 0], mean - std)
            torch.testing.assert_close(summaries[head, block, 1], mean + std)
    # Padding rows must not move the mean: a block of 3 real tokens and 13 huge ones.
    block = torch.full((16, 4), 1e4)
    block[:3] = torch.arange(12.0).view(3, 4)
    masked = summarize_keys(block, valid_tokens=3, kind="moments")
    torch.testing.assert_close(masked, summarize_keys(block[:3], kind="moments"))
    # Padding is whatever the writer's buffer held: NaN or inf there made the whole box NaN.
    for junk in (float("nan"), float("inf"), -float("inf")):
        block[3:] = junk
        for kind in ("moments", "minmax"):
            torch.testing.assert_close(summarize_keys(block, valid_tokens=3, kind=kind), summarize_keys(block[:3], kind=kind))
    assert torch.equal(summarize_request(keys[None], kind="moments")[0], summaries)


def test_unknown_summary_kind_is_refused():
    with pytest.raises(InvalidArgument, match="summary kind"):
        summarize_keys(torch.zeros(16, 4), kind="median")


def test_scores_equal_brute_force_on_random_data():
    torch.manual_seed(3)
    summaries = summarize_layer(torch.randn(200, 2, 64) * 3)
    for shape in [(12, 64), (5, 12, 64)]:  # one token; five draft rows
        queries = torch.randn(shape)
        fast = block_scores(queries, summaries)
        slow = block_scores_reference(queries, summaries)
        assert fast.shape == (*shape[:-2], 2, summaries.shape[1])
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-4)
        # And literally: sum over the group's heads of sum_d max(q_d*min_d, q_d*max_d).
        q = queries.reshape(-1, 2, 6, 64)[-1]
        literal = torch.stack([
            torch.stack([
                sum(torch.maximum(q[h, g] * summaries[h, b, 0], q[h, g] * summaries[h, b, 1]).sum() for g in range(6))
                for b in range(summaries.shape[1])
            ]) for h in range(2)
        ])
        torch.testing.assert_close(fast.reshape(-1, 2, summaries.shape[1])[-1], literal, rtol=1e-5, atol=1e-4)


finite = st.floats(min_value=-50, max_value=50, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tokens=st.integers(1, 70),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([1, 4, 16]),
    scale=st.floats(0.01, 100),
)
def test_bound_is_at_least_the_true_block_max(seed, tokens, kv_heads, group, head_dim, scale):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(tokens, kv_heads, head_dim, generator=g) * scale
    queries = torch.randn(kv_heads * group, head_dim, generator=g)
    summaries = summarize_layer(keys, block_size=16, kind="minmax")
    bound = block_scores(queries, summaries)  # [kv_heads, blocks]
    for block in range(summaries.shape[1]):
        block_keys = keys[block * 16:(block + 1) * 16].float()  # [t, kv_heads, head_dim]
        for head in range(kv_heads):
            q = queries[head * group:(head + 1) * group]  # the GQA group of this KV head
            logits = q @ block_keys[:, head].T  # [group, t]
            per_head_max = logits.max(dim=1).values.sum()  # the bound holds head by head
            tolerance = 1e-4 * (1 + q.abs().sum() * block_keys[:, head].abs().max())
            assert bound[head, block] >= per_head_max - tolerance
            assert bound[head, block] >= logits.sum(0).max() - tolerance


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.lists(finite, min_size=3, max_size=3), min_size=1, max_size=16), query=st.lists(finite, min_size=3, max_size=3))
def test_bound_on_hypothesis_chosen_points(keys, query):
    k = torch.tensor(keys).view(-1, 1, 3)
    q = torch.tensor(query).view(1, 3)
    summaries = summarize_layer(k, block_size=16, kind="minmax")
    bound = block_scores(q, summaries)[0, 0]
    true_max = (k[:, 0] @ q[0]).max()
    assert bound >= true_max - 1e-3 * (1 + q.abs().sum() * k.abs().max())


def test_radius_weight_interpolates_between_center_and_bound():
    torch.manual_seed(3)
    keys = torch.randn(64, 2, 16)
    summaries = summarize_layer(keys, 16)  # [kv_heads, blocks, 2, d]
    queries = torch.randn(3, 4, 16)  # 3 rows, 4 query heads over 2 KV heads
    bound = block_scores(queries, summaries)
    assert torch.equal(block_scores(queries, summaries, 1.0), bound)
    lo, hi = summaries[..., 0, :], summaries[..., 1, :]
    q_sum = queries.reshape(3, 2, 2, 16).sum(dim=2)
    center_only = torch.einsum("rhd,hbd->rhb", q_sum, (lo + hi) / 2)
    torch.testing.assert_close(block_scores(queries, summaries, 0.0), center_only)
    weighted = block_scores(queries, summaries, 0.4)
    torch.testing.assert_close(weighted, center_only + 0.4 * (bound - center_only))
    assert (weighted <= bound + 1e-5).all()


def test_bfloat16_summaries_still_bound_every_key():
    torch.manual_seed(11)
    keys = torch.randn(160, 2, 64) * 7 + 0.003  # 10 blocks, 2 KV heads
    exact = summarize_layer(keys, kind="minmax")
    narrow = narrow_summaries(exact, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16
    wide = narrow.float()
    assert (wide[..., 0, :] <= exact[..., 0, :]).all() and (wide[..., 1, :] >= exact[..., 1, :]).all()
    assert (exact.to(torch.bfloat16).float()[..., 1, :] < exact[..., 1, :]).any()  # nearest would cut the box
    assert ((wide - exact).abs() <= exact.abs() * 2.0**-7).all()  # at most one bfloat16 step wider
    queries = torch.randn(6, 64) * 2  # 3 query heads per KV head
    for head in range(2):
        group = queries.view(2, 3, 64)[head]
        logits = torch.einsum("gd,btd->gbt", group, keys[:, head].reshape(10, 16, 64))
        group_block_max = logits.amax(-1).sum(0)
        assert (block_scores(queries, wide)[head] >= group_block_max - 1e-4).all()


def _narrow_by_nearest_then_nudge(summaries: torch.Tensor) -> torch.Tensor:
    """The reference: round to nearest, then move each element that went inward one bfloat16
    step back out (the implementation before the bit-level one)."""
    narrow = summaries.to(torch.bfloat16)
    wide = narrow.float()
    lo, hi = narrow[..., 0, :], narrow[..., 1, :]
    low_too_high = wide[..., 0, :] > summaries[..., 0, :]
    high_too_low = wide[..., 1, :] < summaries[..., 1, :]
    lo[low_too_high] = torch.nextafter(lo[low_too_high], lo.new_tensor(float("-inf")))
    hi[high_too_low] = torch.nextafter(hi[high_too_low], hi.new_tensor(float("inf")))
    return narrow


def test_bit_level_narrowing_equals_rounding_to_nearest_then_nudging_outward():
    torch.manual_seed(5)
    summaries = torch.randn(3, 2, 50, 2, 64) * torch.logspace(-30, 30, 64)  # every magnitude, both signs
    flat = summaries.view(-1)
    flat[:200] = flat[:200].bfloat16().float()  # exactly representable: must not move
    specials = [0.0, -0.0, float("inf"), float("-inf"), 3.3e38, -3.3e38, 1e-40, -1e-40, 1e-45, -1e-45]
    flat[200 : 200 + len(specials)] = torch.tensor(specials)
    narrow = narrow_summaries(summaries, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and narrow.shape == summaries.shape
    assert torch.equal(narrow.view(torch.int16), _narrow_by_nearest_then_nudge(summaries).view(torch.int16))
    wide = narrow.float()
    assert (wide[..., 0, :] <= summaries[..., 0, :]).all() and (wide[..., 1, :] >= summaries[..., 1, :]).all()
    assert torch.equal(wide.view(-1)[:200], flat[:200])
    # A view that is not contiguous narrows like its copy.
    assert torch.equal(narrow_summaries(summaries[:, :, ::2], torch.bfloat16).view(torch.int16),
                       narrow[:, :, ::2].view(torch.int16))


def test_narrowing_to_an_unsupported_dtype_is_refused():
    with pytest.raises(InvalidArgument, match="float16"):
        narrow_summaries(torch.zeros(1, 2, 4), torch.float16)
    assert narrow_summaries(torch.ones(1, 2, 4), "float32").dtype == torch.float32
    with pytest.raises(InvalidArgument, match="from float32"):
        narrow_summaries(torch.ones(1, 2, 4, dtype=torch.float64), torch.bfloat16)


def test_uint8_codes_bound_their_values_within_a_step_of_each_channels_range():
    torch.manual_seed(12)
    keys = torch.randn(2, 320, 2, 64) * torch.logspace(-1, 2, 64)  # 2 layers, 20 blocks, channels of every scale
    keys[..., 5] += 300.0  # an outlier channel, large and nearly constant across blocks
    exact = summarize_request(keys, kind="minmax")
    coded = quantize_summaries(exact)
    assert coded.codes.dtype == torch.uint8 and coded.shape == exact.shape
    assert coded.nbytes == exact.numel() + 2 * 4 * coded.offset.numel()
    values = coded.dequantize()
    assert (values[..., 0, :] <= exact[..., 0, :]).all() and (values[..., 1, :] >= exact[..., 1, :]).all()
    assert ((values - exact).abs() <= coded.step.unsqueeze(2) * 1.0001 + exact.abs() * 2e-7).all()  # a step, and a rounding
    # Each channel's own range: the outlier channel resolves its blocks as finely as the others.
    span = exact.amax(dim=2) - exact.amin(dim=2)
    assert torch.allclose(coded.step, span / 255, rtol=1e-5)
    assert (coded.codes[..., 0, :].amin(dim=2) == 0).all() and (coded.codes[..., 1, :].amax(dim=2) == 255).all()
    assert ((values - exact).abs()[..., 5] < 0.1).all()  # bfloat16 steps there are 2.0


def test_uint8_codes_rank_blocks_as_their_values_do():
    """The offsets shift every block's logit for a query head alike, so weights times steps
    against the bare codes give the same shares as the weights against the values."""
    torch.manual_seed(13)
    exact = summarize_layer(torch.randn(800, 2, 32) * 3 + 1)  # 50 blocks
    coded = quantize_summaries(exact.unsqueeze(0))
    values = coded.dequantize()[0]
    queries = torch.randn(3, 8, 32)
    shares = rank_blocks(queries, values, 0.2, 0.5)
    q = queries.reshape(3, 2, 4, 32)
    weights = query_weights(q.mean(dim=0), q.abs().mean(dim=0), 0.2, 0.5)  # [kv_heads, group, 2d]
    steps = coded.step[0].reshape(2, 1, 64)
    logits = torch.bmm(weights * steps, coded.codes[0].float().reshape(2, 50, 64).transpose(1, 2))
    assert torch.allclose(softmax_shares(logits), shares, atol=1e-5)


def test_a_channel_equal_in_every_block_gets_a_step_far_below_its_value():
    exact = torch.ones(1, 1, 4, 2, 8) * 2.5
    exact[..., 1, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    coded = quantize_summaries(exact)
    values = coded.dequantize()
    constant = torch.ones_like(exact, dtype=torch.bool)
    constant[..., 1, 0] = False
    assert torch.equal(values[constant], exact[constant])  # code 0 is the offset itself
    assert (values[..., 1, 0] >= exact[..., 1, 0]).all() and float(values[0, 0, -1, 1, 0]) == pytest.approx(4.0)
    assert coded.step[0, 0, 0, 1] < 1e-5 and coded.step[0, 0, 1, 0] == pytest.approx(3 / 255)
    assert not fits_range(exact + 0.001, coded.offset, coded.step).all()
    with pytest.raises(InvalidArgument, match="at least one block"):
        quantize_summaries(exact[:, :, :0])
