"""Token logprobs in the two OpenAI shapes: chat's `content` list and completions' parallel lists.

A token's text is what it adds to the output text when the output is decoded in sequence
(incremental detokenization, as vLLM does), so the texts of a response's tokens join into its
text: a token that holds only part of a character adds "" and the token that completes the
character carries all of it. Decoding a token alone gave U+FFFD for every such piece ("アニ"
came back as five tokens of "\\ufffd", and completions' text_offset ran past the end of the text).

The text follows the server's own output text (`OutputText`, with the request's
skip_special_tokens), so characters appear in the tokens exactly where they appear in the text.

One `LogprobFormatter` serves one request: `chat()`/`completion()` are called with successive
batches of the request's tokens (a stream's events), and the decoding state carries over.
"""

from __future__ import annotations

import copy
import json
import re
import weakref

from ..models.engine.stopping import OutputText
from ..models.sampling import TokenLogprob

_REPLACEMENT = "\ufffd"


class LogprobFormatter:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        """`skip_special_tokens`: the request's, as its output text is decoded with it (a
        skipped special token adds ""). The default is the requests' default."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._raw = _RawBytes.of(tokenizer, skip_special_tokens)
        self._output = OutputText(tokenizer, skip_special_tokens)
        self._ids: list[int] = []  # the request's tokens so far
        self._shown = ""  # the text the tokens so far add up to (the output text, before stop strings)
        # Raw bytes of the tokens so far that the text does not show yet: the first bytes of a
        # character whose last bytes have not come. Chat's `bytes` carried them already.
        self._ahead = b""
        self.text_offset = 0  # completions: where the next token's text starts in the output
        self._at_boundary: dict[int, tuple[str, bytes]] = {}  # see _alternative

    def _alternative(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of `token_id` in the next token's place. A byte-level decoder decodes
        the bytes after a settled character boundary alike whatever came before it, so there
        (nothing held, the output text settled up to the last token) an alternative's text and
        bytes depend on it alone and are computed once per request."""
        if not (self._raw.byte_level and not self._ahead and self._output.read == len(self._ids)):
            return self._step(token_id)[:2]
        found = self._at_boundary.get(token_id)
        if found is None:
            if len(self._at_boundary) > 65536:
                self._at_boundary.clear()
            found = self._at_boundary[token_id] = self._step(token_id)[:2]
        return found

    def _step(self, token_id: int):
        """(text, bytes, state after it) for `token_id` coming next, without taking it."""
        output = copy.copy(self._output)  # its fields are replaced, never changed in place
        self._ids.append(token_id)
        try:
            shown = output.decode(self._ids).rstrip(_REPLACEMENT)
        finally:
            self._ids.pop()
        # What the output text grows by; an unfinished character (U+FFFD at the end) is held
        # back as the output text holds it back, until the token that completes it.
        text = shown[len(self._shown):] if shown.startswith(self._shown) else shown[_common_prefix(shown, self._shown):]
        raw = self._raw(token_id)
        pending = self._ahead + raw
        wanted = text.encode("utf-8")
        rest = pending[len(wanted):]
        if pending.startswith(wanted) and not _is_text(rest):
            # The usual case: the token's raw bytes, some completing the held character, and any
            # left over starting the next one (held until it completes).
            data, ahead = raw, rest
        else:
            tail = raw[len(raw) - min(len(raw), _unfinished(pending)):]  # an unfinished character it starts
            if wanted.startswith(self._ahead):
                # The decoder's text is not the raw bytes (a decoder that strips the first
                # token's leading space, say): the text's own bytes, so that the bytes still
                # join into the text.
                data, ahead = wanted[len(self._ahead):] + tail, tail
            else:
                # Held bytes that never formed a character (the text shows U+FFFD for them): the
                # token's raw bytes, which is what it stands for.
                data, ahead = raw, tail
        return text, data, (output, shown, ahead)

    def _take(self, token_id: int):
        text, data, (self._output, self._shown, self._ahead) = self._step(token_id)
        self._ids.append(token_id)
        return text, data

    def chat(self, entries: list[TokenLogprob]) -> dict:
        # `bytes` are the token's own UTF-8 bytes, so that joining a response's `bytes` gives its
        # text's UTF-8 (OpenAI's meaning). Where vLLM differs: for a token holding only part of a
        # character it gives "" and [] and the completing token all the character's bytes; here
        # the part's token is "" with the part's bytes, and the completing token the rest.
        content = []
        for e in entries:
            # The alternatives first: they are what could have come in this token's place.
            top = [_chat_item(*self._alternative(t), lp) for t, lp in e.top]
            content.append({**_chat_item(*self._take(e.token_id), e.logprob), "top_logprobs": top})
        return {"content": content}

    def completion(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets, tops = [], [], []
        for e in entries:
            alternatives = [(self._alternative(t)[0], lp) for t, lp in e.top]
            text, _ = self._take(e.token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            # As vLLM: the token itself and the alternatives. Tokens that add alike (parts of
            # characters add "") share a key: the token's own logprob first, then each
            # alternative's best.
            top = {text: e.logprob}
            for alternative, lp in alternatives:
                top.setdefault(alternative, lp)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}


# vLLM's stand-in for a logprob of -inf, which JSON cannot carry (`clamp_prompt_logprobs`).
_LOWEST_LOGPROB = -9999.0


class EchoLogprobsGate:
    """A stream's order under echo with logprobs: a choice's echo chunk shows its prompt's
    logprobs, which only the prompt's first choice computes (`PromptLogprobs`), so a sibling's
    events that come before them wait here, in the order they came."""

    def __init__(self, waiting: list[bool], n: int):
        """`waiting[i]`: choice i echoes its prompt with logprobs; `n`: choices per prompt."""
        self._waiting = list(waiting)
        self._n = n
        self.found: dict[int, list[TokenLogprob]] = {}  # prompt -> its logprobs, once they came
        self._held: dict[int, list] = {}  # prompt -> its choices' (index, event)s that came before them

    def passed(self, index: int, event) -> list:
        """The (choice index, event)s that may be written now that choice `index` gave `event`."""
        if not self._waiting[index]:
            return [(index, event)]
        prompt = index // self._n
        if event.prompt_logprobs is not None:
            self.found[prompt] = event.prompt_logprobs
        if prompt not in self.found:
            self._held.setdefault(prompt, []).append((index, event))
            return []
        ready = self._held.pop(prompt, []) + [(index, event)]
        for choice, _ in ready:
            self._waiting[choice] = False
        return ready


class PromptLogprobs:
    """A request's prompts as its response shows them: vLLM's `prompt_logprobs` and completions'
    echo with logprobs. Each prompt's are made once, whichever of its n choices asks first; they
    are the prompt's, not a choice's."""

    def __init__(self, tokenizer, prompts: list[list[int]], echo_top: int | None, shown_top: int | None):
        """`echo_top`: the output's logprobs alternatives (None: no echo with logprobs);
        `shown_top`: `prompt_logprobs`' (None: not shown)."""
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.echo_top = echo_top
        self.shown_top = shown_top
        self._echoed: dict[int, tuple[dict, int]] = {}  # prompt -> (its logprobs, where its text ends)
        self._shown: dict[int, list] = {}
        self._decoded: dict[int, str] = {}

    def echoed(self, prompt: int, entries: list[TokenLogprob]) -> tuple[dict, int]:
        """Completions' logprobs of echoed prompt `prompt`, which precede the output's, and the
        text offset the output's continue from (a BOS the tokenizer added shows in the tokens,
        not in the prompt's text). As vLLM gives them, the first token's logprob and
        alternatives are null; special tokens are shown, as the prompt shows them. The lists are
        fresh copies: a caller extends them."""
        if prompt not in self._echoed:
            ids, top = self.prompts[prompt], self.echo_top
            formatter = LogprobFormatter(self.tokenizer, skip_special_tokens=False)
            shown = formatter.completion([TokenLogprob(ids[0], 0.0)]
                                         + [TokenLogprob(e.token_id, e.logprob, e.top[:top]) for e in entries])
            shown["token_logprobs"][0] = shown["top_logprobs"][0] = None
            self._echoed[prompt] = shown, formatter.text_offset
        shown, end = self._echoed[prompt]
        return {key: list(value) for key, value in shown.items()}, end

    def shown(self, prompt: int, entries: list[TokenLogprob]) -> list[dict | None]:
        """vLLM's `prompt_logprobs` of prompt `prompt`: null for its first token (nothing comes
        before it), then for each token {token id: {logprob, rank, decoded_token}} of the token
        itself and its best alternatives, each token decoded alone as vLLM decodes them. As
        vLLM's, an alternative that is the token itself gives its entry."""
        if prompt not in self._shown:
            positions: list[dict | None] = [None]
            for e in entries:
                position = {str(e.token_id): self._item(e.token_id, e.logprob, e.rank)}
                for rank, (token_id, logprob) in enumerate(e.top[: self.shown_top], 1):
                    position[str(token_id)] = self._item(token_id, logprob, rank)
                positions.append(position)
            self._shown[prompt] = positions
        return self._shown[prompt]

    def _item(self, token_id: int, logprob: float, rank: int | None) -> dict:
        if token_id not in self._decoded:
            self._decoded[token_id] = self.tokenizer.decode([token_id])
        return {"logprob": max(logprob, _LOWEST_LOGPROB), "rank": rank, "decoded_token": self._decoded[token_id]}


def _chat_item(text: str, data: bytes, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(data)}


def _is_text(data: bytes) -> bool:
    """Whether `data` is one or more whole characters (bytes the text should have shown)."""
    try:
        return bool(data.decode("utf-8"))
    except UnicodeDecodeError:
        return False


def _unfinished(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that is not complete."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the character's first byte, or ASCII
            needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return back if needed > back else 0
    return 0


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _RawBytes:
    """The bytes a token id stands for, as the tokenizer's decoder reads it: byte-level BPE
    tokens (GPT-2's, SmolLM2's, Qwen's) through the bytes-to-unicode table; SentencePiece byte
    tokens "<0xE3>" (Gemma's byte fallback) as that byte; other tokens as their text. A special
    token the request skips stands for no bytes."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, tokenizer, skip_special_tokens: bool) -> _RawBytes:
        try:
            per_tokenizer = cls._cache.setdefault(tokenizer, {})
        except TypeError:  # not weakly referable: not cached
            return cls(tokenizer, skip_special_tokens)
        if skip_special_tokens not in per_tokenizer:
            per_tokenizer[skip_special_tokens] = cls(tokenizer, skip_special_tokens)
        return per_tokenizer[skip_special_tokens]

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        inner = getattr(tokenizer, "tokenizer", None)  # a ChatTokenizer's `tokenizers.Tokenizer`
        self._inner = inner if hasattr(inner, "id_to_token") else None
        self._special: set[int] = set()
        self.byte_level = False
        self._byte_fallback = False
        self._replace: list[tuple[str, str]] = []
        if self._inner is None:
            return
        if skip_special_tokens:
            self._special = {i for i, t in self._inner.get_added_tokens_decoder().items() if t.special}
        try:
            config = json.loads(self._inner.decoder.__getstate__())
        except Exception:  # no decoder, or one that does not say what it is
            config = {}
        steps = config.get("decoders", [config]) if config.get("type") == "Sequence" else [config]
        for step in steps:
            kind = step.get("type")
            if kind == "ByteLevel":
                self.byte_level = True
            elif kind == "ByteFallback":
                self._byte_fallback = True
            elif kind == "Replace" and isinstance(step.get("pattern", {}).get("String"), str):
                self._replace.append((step["pattern"]["String"], step.get("content", "")))
            elif kind == "Metaspace":
                self._replace.append((step.get("replacement", "\u2581"), " "))

    def __call__(self, token_id: int) -> bytes:
        data = self._bytes.get(token_id)
        if data is None:
            if len(self._bytes) > 65536:  # bounded, though a vocabulary is
                self._bytes.clear()
            data = self._bytes[token_id] = self._compute(token_id)
        return data

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        piece = self._inner.id_to_token(token_id) if self._inner is not None else None
        if piece is None:  # a stand-in tokenizer, or an id it does not know
            return self.tokenizer.decode([token_id]).encode("utf-8")
        if self.byte_level:
            # As the ByteLevel decoder: a token with a character outside the table is its UTF-8.
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        if self._byte_fallback:
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        for pattern, content in self._replace:
            piece = piece.replace(pattern, content)
        if self._byte_fallback or self._replace:
            return piece.encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")  # a decoder not known here: its text


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte's printable stand-in character in byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
