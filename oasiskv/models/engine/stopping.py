"""When a request stops, and the text it shows: shared by every engine that emits tokens."""

from __future__ import annotations

from ..sampling import SamplingParams


def request_eos_ids(model_config, tokenizer=None) -> set[int]:
    """The ids that end a request: the model config's and the tokenizer's (a chat model's
    tokenizer may end turns with a token its config does not list)."""
    return set(model_config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()))


def finish_reason(token: int, num_output: int, params: SamplingParams, eos_token_ids, context_full: bool) -> str | None:
    """Reason to stop after emitting `token` as output number `num_output` (1-based)."""
    # Before min_tokens the sampler never picks a stop token; one that comes anyway (a first token
    # from vLLM, whose EOS ids may be fewer) must not end the output early either.
    is_stop = token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)
    if is_stop and num_output > params.min_tokens:
        return "stop"
    if num_output >= params.max_tokens or context_full:
        return "length"
    return None


class OutputText:
    """One request's output decoded incrementally: a call decodes only the tokens after the last
    settled character boundary, with the tokens before it since the previous boundary as context
    (decoders treat a sequence's first token specially), so its cost does not grow with the
    output. A whole decode of 16,000 output tokens took 2 to 5 ms, for every request at every
    step (bench/step_host_work.py).

    `decode(ids)` equals the tokenizer's whole decode of `ids`, provided each call's ids extend
    the previous call's, as a request's output does; fewer ids than last time start it over.
    Exceptions keep a text from ever taking back what it showed. A byte-fallback decoder
    (Gemma's) decodes a run of byte tokens together, and turns a whole character back into
    U+FFFD once the next character's first byte joins its run: the shown text lost it, and a
    stream that sent the text's growth sent it twice. So while the last character's bytes are
    still arriving, the characters before it show as they were; and where the run never
    finishes that character, the text goes on from what was shown (as the sum of a vLLM
    stream's pieces does), not from the decoder's rewrite of the whole run."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._restart()

    def _restart(self) -> None:
        self.settled = ""  # the text of ids[:self.read], ending on a whole character
        self.context = 0  # where the next decode starts: the boundary before self.read
        self.read = 0
        self._prefix: tuple[int, int] | None = None  # (n, prefix_chars(ids, n)) last computed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.skip_special_tokens \
            else self.tokenizer.decode(ids)

    def prefix_chars(self, ids: list[int], n: int) -> int:
        """Characters of the text of ids[:n], decoded once per request (the output only grows)."""
        if self._prefix is None or self._prefix[0] != n:
            self._prefix = (n, _prefix_chars(self._decode, ids, n))
        return self._prefix[1]

    def decode(self, ids: list[int]) -> str:
        if len(ids) < self.read:
            self._restart()
        decode = self._decode
        before = decode(ids[self.context : self.read]) if self.read > self.context else ""
        now = decode(ids[self.context :])
        if not now.startswith(before):
            if now.endswith("\ufffd"):
                return self.settled  # a byte run with an unfinished character: what it settles into comes later
            whole = decode(ids)
            if whole.startswith(self.settled):  # a decoder that rewrote its context: decode it all once
                self._restart()
                before, now = "", whole
            else:
                # The run never finished its character and a later token closed it: the decoder
                # now spells the whole run, shown characters too, as U+FFFD. What was shown stays;
                # the new tokens add their own text.
                before, now = "", decode(ids[self.read :])
        new = now[len(before) :]
        if new and not new.endswith("\ufffd"):
            self.settled += new
            self.context, self.read = self.read, len(ids)
            return self.settled
        return self.settled + new


def visible_text(tokenizer, output_ids: list[int], params: SamplingParams, reason: str | None, eos_token_ids):
    """Detokenized output without a final EOS or a final unfinished character, cut before the
    first stop string (after it with `include_stop_str_in_output`). `tokenizer`:
    anything with decode(ids), a request's `OutputText` to decode only what is new.
    Returns (text, reason) where reason becomes "stop" when a stop string was found.

    While the request runs (reason None) the text is only what later tokens cannot change, so
    every text a request shows extends the one before and streams can send the difference: a
    character whose UTF-8 bytes have not all arrived (decoded as U+FFFD) and an ending that may
    still grow into a stop string are held back until the next tokens settle them."""
    ids = output_ids
    # As vLLM: the token that ended the output (EOS or one of stop_token_ids) is not in its text,
    # unless include_stop_str_in_output asks for it.
    if (reason == "stop" and ids and not params.include_stop_str_in_output
            and (ids[-1] in eos_token_ids or ids[-1] in params.stop_token_ids)):
        ids = ids[:-1]
    text = tokenizer.decode(ids)
    found = _first_stop_string(tokenizer, ids, text, params)
    if found:
        cut, stop = found
        return text[: cut + len(stop) if params.include_stop_str_in_output else cut], "stop"
    if reason is None:
        text = _settled(text, params.stop)
    else:
        # As vLLM: bytes of a character the output ended before completing are not shown.
        text = text.rstrip("\ufffd")
    return text, reason


def stop_reason(tokenizer, output_ids: list[int], params: SamplingParams, eos_token_ids) -> str | int | None:
    """What ended an output that finished with "stop", as vLLM reports it in `stop_reason`: the
    token id from `stop_token_ids`, the stop string that matched, or None for an EOS."""
    last = output_ids[-1] if output_ids else None
    if last is not None and not params.ignore_eos and last in eos_token_ids:
        return None
    if last in params.stop_token_ids:
        return last
    found = _first_stop_string(tokenizer, output_ids, tokenizer.decode(output_ids), params)
    return found[1] if found else None


def _first_stop_string(tokenizer, ids: list[int], text: str, params: SamplingParams) -> tuple[int, str] | None:
    """(where it starts, the stop string) for the stop string that comes first in `text`; None
    when none ends after the first min_tokens tokens (as vLLM: one counts only from there)."""
    if not params.stop or len(ids) <= params.min_tokens:
        return None
    protected = _protected_chars(tokenizer, ids, params.min_tokens)
    found = [(i, s) for i, s in ((text.find(s, max(0, protected - len(s) + 1)), s) for s in params.stop) if i >= 0]
    return min(found, key=lambda f: (f[0], len(f[1]))) if found else None


def _protected_chars(tokenizer, ids: list[int], min_tokens: int) -> int:
    """Characters of the text of the first min_tokens output tokens (no stop string ends there)."""
    if not min_tokens:
        return 0
    if hasattr(tokenizer, "prefix_chars"):  # an OutputText: decoded once, not at every step
        return tokenizer.prefix_chars(ids, min_tokens)
    return _prefix_chars(tokenizer.decode, ids, min_tokens)


def _prefix_chars(decode, ids: list[int], n: int) -> int:
    # A character whose bytes the next token completes is not part of the protected text: it
    # ends after the first n tokens.
    return len(decode(ids[:n]).rstrip("\ufffd"))


def _settled(text: str, stops: list[str]) -> str:
    text = text.rstrip("\ufffd")
    held = max((_stop_prefix_at_end(text, stop) for stop in stops), default=0)
    return text[: len(text) - held]


def _stop_prefix_at_end(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with (0: none)."""
    tail = text[max(0, len(text) - len(stop) + 1) :] if len(stop) > 1 else ""
    start = tail.find(stop[0]) if tail else -1
    while start >= 0:  # only where the stop's first character occurs can a prefix of it begin
        if stop.startswith(tail[start:]):
            return len(tail) - start
        start = tail.find(stop[0], start + 1)
    return 0
