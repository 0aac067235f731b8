"""Key summaries and the block score computed from them.

A block's summary, per layer and KV head, is a box around its post-RoPE keys: two vectors (lo,
hi) of head_dim each, stored and moved as one [2, head_dim] pair. Two kinds (`KVLayout.summary_kind`):

- `minmax` (Quest): the element-wise min and max over the block's tokens, the smallest box that
  contains every key, so the score below (radius weight 1) is an upper bound of q.k.
- `moments` (the default): the element-wise mean +- standard deviation. Same bytes, same scorer.
  With the estimated logit q.mean + 0.5 |q|.std, the draft rows found 75.9% / 67.5% of the next
  query's exact top-128 blocks at 8K / 16K against 73.2% / 64.2% with min/max (Qwen2.5-Coder-0.5B,
  bench/lookahead_accuracy.py). Likely because one outlying key moves the middle of a block's range
  far more than its mean. Its box is not a bound.

For the min/max box and a query q,

    q . k = sum_d q_d k_d  <=  sum_d max(q_d * min_d, q_d * max_d)

for every key k in the box, so this is an upper bound of the block's largest attention logit
(before scaling). With center c = (min+max)/2 and radius r = (max-min)/2,
max(q_d min_d, q_d max_d) = q_d c_d + |q_d| r_d, so the bound is two dot products, and its sum
over the query heads of a GQA group is (sum_g q_g) . c + (sum_g |q_g|) . r: two matmuls for
all blocks at once.

Summaries are float32, shape [layers, kv_heads, blocks, 2 (lo, hi), head_dim]. They may be read
in bfloat16 (half the bytes moved): `narrow_summaries` rounds lo down and hi up, so a narrowed
min/max box still contains every key and the bound stays a bound. Or as 8-bit codes (a quarter),
`QuantizedSummaries`: one offset and step per (layer, KV head, lo/hi, channel) over the request's
blocks, the codes rounded outward too. A block's estimated logit is linear in its summary, so
the offsets add the same amount to every block's logit for a query head, which its softmax over
the blocks ignores: ranking needs only the codes and the steps (`query_weights` times the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import InvalidArgument

SUMMARY_KINDS = ("minmax", "moments")
DEFAULT_SUMMARY_KIND = "moments"

# A block's estimated logit is q.center + w |q|.radius (rank_blocks), w measured for each kind on
# Qwen2.5-Coder-0.5B (bench/lookahead_accuracy.py): 0.2 for min/max, whose radius is the spread of
# the most extreme keys; 0.5 for mean +- std, whose radius is a typical spread (at 8K recall was
# flat from 0.3 to 0.5, within 0.2 points, and fell by 1 point at 0.8).
RANKING_RADIUS_WEIGHTS = {"minmax": 0.2, "moments": 0.5}

# What a summary may be read as; float16 is left out because keys can exceed its range.
SUMMARY_READ_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
CODE_LEVELS = 255  # the largest 8-bit code
HI_SIDE = torch.tensor([[False], [True]])  # broadcasts over a summary's (lo, hi) axis and head_dim

# Dtypes torch reduces natively on CPU and that can hold +-inf (float8 can do neither).
_NATIVE_MINMAX = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_summary_kind(kind: str) -> str:
    if kind not in SUMMARY_KINDS:
        raise InvalidArgument(f"summary kind must be one of {list(SUMMARY_KINDS)}, not {kind!r}")
    return kind


def ranking_radius_weight(kind: str) -> float:
    """The radius weight `rank_blocks` uses with summaries of `kind`."""
    return RANKING_RADIUS_WEIGHTS[check_summary_kind(kind)]


def summarize_keys(keys: torch.Tensor, valid_tokens: int | torch.Tensor | None = None,
                   kind: str = DEFAULT_SUMMARY_KIND) -> torch.Tensor:
    """[..., block_size, head_dim] keys -> [..., 2, head_dim] float32 (lo, hi) boxes of `kind`.

    valid_tokens (int, or a tensor broadcastable to keys.shape[:-2]) excludes the padding rows of
    a partly filled block; every summarized block must have at least one valid token.
    """
    if check_summary_kind(kind) == "moments":
        return _moment_boxes(keys, valid_tokens)
    if keys.dtype not in _NATIVE_MINMAX:
        keys = keys.float()
    # min/max are exact in any dtype, so reducing natively and widening the result is
    # bit-identical to widening first, and several times faster (amin+amax beat aminmax too).
    if valid_tokens is None:
        return torch.stack((keys.amin(dim=-2), keys.amax(dim=-2)), dim=-2).float()
    rows = torch.arange(keys.shape[-2], device=keys.device)
    valid = torch.as_tensor(valid_tokens, device=keys.device)
    padding = (rows >= valid.unsqueeze(-1)).unsqueeze(-1)  # [..., block_size, 1]
    lo = keys.masked_fill(padding, float("inf")).amin(dim=-2)
    hi = keys.masked_fill(padding, float("-inf")).amax(dim=-2)
    return torch.stack((lo, hi), dim=-2).float()


def _moment_boxes(keys: torch.Tensor, valid_tokens: int | torch.Tensor | None) -> torch.Tensor:
    """mean -+ population standard deviation over the (valid) tokens, float32. Contiguous first:
    sums over a strided view may add in another order, and the store's summary of a block must
    equal the decode node's own summary of the same keys, bit for bit."""
    keys = keys.float().contiguous()
    # One formula for whole and partial blocks (padding rows weigh 0): torch's mean() adds in
    # another order than sum() / n, and the two paths must agree on a whole block.
    rows = torch.arange(keys.shape[-2], device=keys.device)
    valid = torch.as_tensor(keys.shape[-2] if valid_tokens is None else valid_tokens, device=keys.device)
    weight = (rows < valid.unsqueeze(-1)).unsqueeze(-1).float()  # [..., block_size, 1]
    # Padding is whatever the writer's buffer held: a weight of 0 does not hide NaN or inf (0 * inf
    # is NaN), and the whole box became NaN.
    keys = torch.where(weight.bool(), keys, 0.0)
    count = weight.sum(dim=-2)
    mean = (keys * weight).sum(dim=-2) / count
    std = (((keys - mean.unsqueeze(-2)) ** 2 * weight).sum(dim=-2) / count).sqrt()
    return torch.stack((mean - std, mean + std), dim=-2)


def summary_read_dtype(name: str | torch.dtype) -> torch.dtype:
    """A summary read dtype by name (or dtype), or InvalidArgument naming the choices."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if name not in SUMMARY_READ_DTYPES:
        raise InvalidArgument(f"summaries can be read as {sorted(SUMMARY_READ_DTYPES)}, not {name!r}")
    return SUMMARY_READ_DTYPES[name]


def narrow_summaries(summaries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 [..., 2 (lo, hi), head_dim] -> dtype, rounding lo toward -inf and hi toward +inf:
    round-to-nearest would shrink a min/max box, and a key outside its box could make
    block_scores underrate the block that holds it (a moments box just widens by an ulp)."""
    dtype = summary_read_dtype(dtype)
    if dtype == summaries.dtype:
        return summaries
    if summaries.dtype != torch.float32 or dtype != torch.bfloat16:
        raise InvalidArgument(f"summaries narrow from float32 to bfloat16, not {summaries.dtype} to {dtype}")
    # bfloat16 is float32's upper half: cutting the lower half rounds toward zero, which is
    # down for a positive lo and up for a positive hi. A value with bits cut off moves one
    # bfloat16 step away from zero where that is the outward direction (a negative lo, a
    # positive hi). On the bits, in numpy (the store's summaries are in host memory): a 16K
    # request's summaries (3.1 M numbers) narrow in ~6 ms, against ~40 ms for the same ops in
    # torch and 210 ms for rounding to nearest and then nudging back, with masked nextafter,
    # the elements that went inward.
    bits = summaries.detach().cpu().contiguous().numpy().view(np.int32)
    is_hi = np.array([[False], [True]])  # the (lo, hi) axis
    outward = (bits < 0) ^ is_hi  # lo: away from zero when negative; hi: when positive
    upper = (bits >> 16).astype(np.int16)
    upper += ((bits & 0xFFFF) != 0) & outward  # sign-magnitude: +1 is one step away from zero
    return torch.from_numpy(upper).view(torch.bfloat16).to(summaries.device)


@dataclass
class QuantizedSummaries:
    """Summaries as 8-bit codes: a value is offset + code * step, the offset and step per (layer,
    KV head, lo/hi, channel). Per channel, because keys have a few channels far larger than the
    rest and nearly constant across blocks: a range per channel resolves the differences between
    blocks there, where a scale per block (or bfloat16's relative precision) spends its bits on
    the common part. Measured (Qwen 0.5B, 8K, bench/lookahead_accuracy.py): the same recall of
    the next step's top-K as bfloat16 summaries, for half their bytes."""

    codes: torch.Tensor  # uint8 [layers, kv_heads, blocks, 2, head_dim]
    offset: torch.Tensor  # float32 [layers, kv_heads, 2, head_dim]
    step: torch.Tensor  # float32 [layers, kv_heads, 2, head_dim], > 0

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        """What the codes and their ranges take to move: the codes, plus 2 x 4 bytes per channel."""
        return self.codes.nbytes + self.offset.nbytes + self.step.nbytes

    def dequantize(self) -> torch.Tensor:
        """float32 [layers, kv_heads, blocks, 2, head_dim]."""
        return self.offset.unsqueeze(2) + self.codes.float() * self.step.unsqueeze(2)


def summary_ranges(summaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [layers, kv_heads, blocks, 2, d] (at least one block) -> (offset, step) [layers,
    kv_heads, 2, d]: each channel's range over the blocks in CODE_LEVELS steps. A channel whose
    blocks are all equal gets a step far below its magnitude, so any later value that differs
    falls outside the range (and `fits_range` says so) instead of onto a coarse grid."""
    lo = torch.stack([layer.amin(dim=1) for layer in summaries])  # a layer at a time, as quantize_summaries
    hi = torch.stack([layer.amax(dim=1) for layer in summaries])
    step = (hi - lo) / CODE_LEVELS * (1 + 2.0**-20)  # the top code's value not a rounding below hi
    tiny = lo.abs().clamp_min(1e-30) * 2.0**-20
    return lo, torch.where(step > tiny, step, tiny)


def fits_range(summaries: torch.Tensor, offset: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """bool [layers, kv_heads, 2, d]: every block of `summaries` lies in the channel's range."""
    top = offset + CODE_LEVELS * step
    return (summaries.amin(dim=2) >= offset) & (summaries.amax(dim=2) <= top)


def quantize_summaries(summaries: torch.Tensor, offset: torch.Tensor | None = None,
                       step: torch.Tensor | None = None) -> QuantizedSummaries:
    """float32 [layers, kv_heads, blocks, 2, d] -> codes, over their own ranges (`summary_ranges`)
    or the given ones. lo rounds down and hi up (as `narrow_summaries` does), so a min/max box
    stays around its keys; values outside a given range clamp to its ends (`fits_range` first)."""
    summaries = summaries.float()
    if offset is None or step is None:
        if summaries.shape[2] == 0:
            raise InvalidArgument("quantizing summaries needs at least one block, or the ranges to use")
        offset, step = summary_ranges(summaries)
    if summaries[0].numel() < 1 << 16:  # a few blocks (a write-back): one pass, not one per layer
        return QuantizedSummaries(code_values(summaries, offset.unsqueeze(2), step.unsqueeze(2)), offset, step)
    codes = torch.empty(summaries.shape, dtype=torch.uint8, device=summaries.device)
    # A layer at a time: a 32K request's summaries are 116 MiB of float32 per temporary, which
    # fresh mappings page-fault in; a layer's stay in cache (0.31 s a request before, measured).
    for layer in range(summaries.shape[0]):
        codes[layer] = code_values(summaries[layer], offset[layer].unsqueeze(1), step[layer].unsqueeze(1))
    return QuantizedSummaries(codes, offset, step)


def code_values(values: torch.Tensor, offset: torch.Tensor, step: torch.Tensor,
                upward: torch.Tensor = HI_SIDE) -> torch.Tensor:
    """float32 values -> uint8 codes on the ranges `offset`, `step` (both broadcast against
    `values`), clamped to the range: rounded up where `upward` (a hi), else down (a lo). The
    default marks the hi side of [..., 2 (lo, hi), d] summaries."""
    upward = upward.to(values.device)
    sign = 1.0 - 2.0 * upward.float()  # ceil(x) = -floor(-x): one in-place pass rounds both ways
    codes = values - offset
    codes /= step
    codes *= sign
    codes.floor_()
    codes *= sign
    codes.clamp_(0, CODE_LEVELS)
    # The division rounds: a code whose value (as `dequantize` computes it, code * step + offset)
    # lands a rounding inside the box (above a lo, below a hi) moves one step out, within the range.
    inward = codes * step
    inward += offset
    inward -= values
    inward *= sign
    codes -= (inward > 0) * sign
    return codes.clamp_(0, CODE_LEVELS).to(torch.uint8)


def read_as(summaries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | QuantizedSummaries:
    """The store's float32 summaries as a reader asked for them (`SUMMARY_READ_DTYPES`)."""
    dtype = summary_read_dtype(dtype)
    if dtype == torch.uint8:
        return quantize_summaries(summaries)
    return narrow_summaries(summaries, dtype)


def summarize_layer(keys: torch.Tensor, block_size: int = 16, kind: str = DEFAULT_SUMMARY_KIND) -> torch.Tensor:
    """[tokens, kv_heads, head_dim] keys of one layer -> [kv_heads, blocks, 2, head_dim]."""
    tokens, heads, head_dim = keys.shape
    blocks = -(-tokens // block_size)
    padded = keys.new_zeros((blocks * block_size, heads, head_dim))
    padded[:tokens] = keys
    per_block = padded.view(blocks, block_size, heads, head_dim).permute(2, 0, 1, 3)
    valid = (tokens - torch.arange(blocks, device=keys.device) * block_size).clamp(max=block_size)
    return summarize_keys(per_block, valid, kind)


def summarize_request(keys: torch.Tensor, block_size: int = 16, kind: str = DEFAULT_SUMMARY_KIND) -> torch.Tensor:
    """[layers, tokens, kv_heads, head_dim] -> [layers, kv_heads, blocks, 2, head_dim]."""
    return torch.stack([summarize_layer(layer_keys, block_size, kind) for layer_keys in keys])


def block_scores(queries: torch.Tensor, summaries: torch.Tensor, radius_weight: float = 1.0) -> torch.Tensor:
    """Upper bound of q . k in every block, summed over the query heads of each GQA group.

    queries:   [..., num_q_heads, head_dim]  (any leading dims: draft rows, requests...)
    summaries: [kv_heads, blocks, 2, head_dim]  (one layer)
    returns    [..., kv_heads, blocks] float32

    With radius_weight < 1 the score is no longer a bound but (q . center) + w (|q| . radius), a
    better ranking of blocks (RANKING_RADIUS_WEIGHTS).
    """
    kv_heads, _, two, head_dim = summaries.shape
    q_heads = queries.shape[-2]
    if two != 2 or queries.shape[-1] != head_dim or q_heads % kv_heads:
        raise InvalidArgument(
            f"queries {tuple(queries.shape)} do not fit summaries {tuple(summaries.shape)} "
            "(need [..., q_heads, head_dim] with q_heads a multiple of kv_heads)"
        )
    q = queries.float().reshape(*queries.shape[:-2], kv_heads, q_heads // kv_heads, head_dim)
    q_sum = q.sum(dim=-2)
    q_abs = q.abs().sum(dim=-2)
    lo = summaries[..., 0, :].float()
    hi = summaries[..., 1, :].float()
    center = (lo + hi) * 0.5
    radius = (hi - lo) * 0.5
    if radius_weight != 1.0:
        radius = radius * radius_weight
    return torch.einsum("...hd,hbd->...hb", q_sum, center) + torch.einsum("...hd,hbd->...hb", q_abs, radius)


def rank_blocks(queries: torch.Tensor, summaries: torch.Tensor, scale: float,
                radius_weight: float) -> torch.Tensor:
    """How much attention each block can expect from a GQA group, estimated from the summaries.

    queries:   [rows, num_q_heads, head_dim]  (several rows, e.g. the draft rows, are averaged)
    summaries: [kv_heads, blocks, 2, head_dim]  (one layer; only the blocks to rank among)
    returns    [kv_heads, blocks] float32, each KV head's rows summing to its group size

    Each query head's estimated logit of a block, scale * (q.center + w |q|.radius), goes through a
    softmax over the blocks, and the group's heads add up their shares. Summing raw logits over
    the group instead lets one head's very low logit for a block outvote another head that
    attends to it; this estimate found 3-4 points more of the exact top-K blocks (Qwen 0.5B:
    73.2% vs 70.1% at 8K, 64.2% vs 59.8% at 16K; bench/lookahead_accuracy.py).
    """
    kv_heads, num_blocks, two, head_dim = summaries.shape
    if queries.dim() != 3 or two != 2 or queries.shape[-1] != head_dim or queries.shape[1] % kv_heads:
        raise InvalidArgument(
            f"queries {tuple(queries.shape)} do not fit summaries {tuple(summaries.shape)} "
            "(need [rows, q_heads, head_dim] with q_heads a multiple of kv_heads)"
        )
    q = queries.float().reshape(queries.shape[0], kv_heads, -1, head_dim)
    weights = query_weights(q.mean(dim=0), q.abs().mean(dim=0), scale, radius_weight)
    flat = summaries.float().reshape(kv_heads, num_blocks, 2 * head_dim)
    if num_blocks == 0:
        return flat.new_zeros((kv_heads, 0))
    return softmax_shares(torch.bmm(weights, flat.transpose(1, 2)))  # logits [kv_heads, group, blocks]


def query_weights(q_mean: torch.Tensor, q_abs: torch.Tensor, scale: float, radius_weight) -> torch.Tensor:
    """[..., d] query rows' mean and mean |q| (the logit is linear in q, so rows average first) ->
    [..., 2d] weights whose product with a stored [lo; hi] summary is scale * (q.center + w |q|.radius):
    q.center + w|q|.radius = lo.(q - w|q|)/2 + hi.(q + w|q|)/2, one matmul against the summaries as
    stored. `radius_weight` is a float or a tensor that broadcasts against q_abs."""
    q_abs = q_abs * radius_weight
    return torch.cat(((q_mean - q_abs) * (0.5 * scale), (q_mean + q_abs) * (0.5 * scale)), dim=-1)


def softmax_shares(logits: torch.Tensor) -> torch.Tensor:
    """[..., group, blocks] logits -> [..., blocks]: each query head's softmax over the blocks,
    summed over the group's heads."""
    if logits.device.type == "cpu":
        return _softmax_shares_numpy(logits)
    return torch.softmax(logits, dim=-1).sum(dim=-2)


def _softmax_shares_numpy(logits: torch.Tensor) -> torch.Tensor:
    """torch.softmax(logits, -1).sum(-2) in numpy. Measured on this 2-core machine, with the
    model's GEMMs in between as in a decode step (1,000 blocks, Qwen 0.5B's 7 heads per group):
    torch's softmax splits across OpenMP threads whose wake-up cost more than the work, and
    numpy's matmul (OpenBLAS) left its threads spinning against torch's: 0.14 ms a call this
    way, 0.39 ms with the matmul in numpy too."""
    shares = logits.numpy()
    shares -= shares.max(axis=-1, keepdims=True)
    np.exp(shares, out=shares)
    shares /= shares.sum(axis=-1, keepdims=True)
    return torch.from_numpy(shares.sum(axis=-2))


def block_scores_reference(queries: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """The bound written literally, sum_d max(q_d*min_d, q_d*max_d); for tests and checks."""
    kv_heads = summaries.shape[0]
    q_heads = queries.shape[-2]
    group = q_heads // kv_heads
    q = queries.float().reshape(*queries.shape[:-2], kv_heads, group, 1, queries.shape[-1])
    lo = summaries[:, None, :, 0, :].float()  # [kv_heads, 1, blocks, head_dim]
    hi = summaries[:, None, :, 1, :].float()
    return torch.maximum(q * lo, q * hi).sum(dim=-1).sum(dim=-2)
