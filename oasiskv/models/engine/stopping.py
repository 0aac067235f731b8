"""When a request stops, and the text it shows: shared by every engine that emits tokens."""

from __future__ import annotations

from ..sampling import SamplingParams


def finish_reason(token: int, num_output: int, params: SamplingParams, eos_token_ids, context_full: bool) -> str | None:
    """Reason to stop after emitting `token` as output number `num_output` (1-based)."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return "stop"
    if num_output >= params.max_tokens or context_full:
        return "length"
    return None


def visible_text(tokenizer, output_ids: list[int], params: SamplingParams, reason: str | None, eos_token_ids):
    """Detokenized output without a final EOS, cut before the first stop string.
    Returns (text, reason) where reason becomes "stop" when a stop string was found."""
    ids = output_ids
    if reason == "stop" and ids and ids[-1] in eos_token_ids and ids[-1] not in params.stop_token_ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids)
    if params.stop:
        cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], "stop"
    return text, reason
