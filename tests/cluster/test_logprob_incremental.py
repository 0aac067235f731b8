"""Token logprobs' texts, bytes and offsets against the tokenizers' own decoding, for random
outputs: text with CJK and emoji (characters split across tokens) and random token ids.

Oracles: the tokenizer's decode of all the ids (what the response text is made from); the UTF-8
of that text; each alternative against a run where it was the token chosen. Tokenizers:
SmolLM2's and Qwen's (byte-level BPE), Gemma 3's if pulled, and small SentencePiece-style ones
with byte fallback built here (Gemma's decoder, and Llama 2's, which strips the first space)."""

from __future__ import annotations

import random

import pytest

from oasiskv.cluster.logprobs import LogprobFormatter
from oasiskv.models.engine.stopping import OutputText, visible_text
from oasiskv.models.pull import resolve_model
from oasiskv.models.sampling import SamplingParams, TokenLogprob
from oasiskv.models.tokenizer import ChatTokenizer, load_tokenizer

CHARS = ("abc xyz,.\n" "日本の首都は東京です" "アニメ、漢字" "한국어" "éüß" "😀🎉👍🏽🇯🇵" "\u2581<>")


def _model(name: str) -> ChatTokenizer:
    return load_tokenizer(resolve_model(name, progress=False))  # pulled once, as the server would


def _byte_fallback(strip_first_space: bool = False) -> ChatTokenizer:
    """A SentencePiece-style tokenizer: pieces with "▁" for a space, bytes "<0xHH>" for the
    characters it has no piece for. Gemma 3's decoder (Replace, ByteFallback, Fuse), or Llama 2's
    (the same, then Strip of the first space)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pieces = ["<unk>", "<bos>", "<eos>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += list("abcxyz,.\n日本の首都は東京で") + ["\u2581", "\u2581a", "\u2581abc", "日本", "首都", "アニ", "東京です"]
    vocab = [(p, 0.0 if i < 259 else -1.0 - len(p) * 0.1) for i, p in enumerate(pieces)]
    vocab[3:259] = [(p, -20.0) for p, _ in vocab[3:259]]  # bytes only where nothing else fits
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_first_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens([AddedToken("<bos>", special=True), AddedToken("<eos>", special=True)])
    return ChatTokenizer(tokenizer, {"bos_token": "<bos>", "eos_token": "<eos>"})


TOKENIZERS = {
    "smollm2": lambda: _model("smollm2-135m"),
    "qwen": lambda: _model("qwen2.5-coder-0.5b"),
    "gemma3": lambda: _model("gemma3-270m"),
    "byte-fallback": _byte_fallback,
    "byte-fallback-strip": lambda: _byte_fallback(strip_first_space=True),
}


@pytest.fixture(scope="module", params=[
    # Gemma 3's own tokenizer in the slow suite (its pull is large); the byte-fallback tokenizers
    # built above have its decoder.
    pytest.param(name, marks=pytest.mark.slow) if name == "gemma3" else name for name in TOKENIZERS])
def tokenizer(request):
    return TOKENIZERS[request.param]()


def _byte_level(tokenizer) -> bool:
    return '"ByteLevel"' in tokenizer.tokenizer.decoder.__getstate__().decode()


def _special_ids(tokenizer) -> list[int]:
    return [i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special]


def _byte_ids(tokenizer) -> list[int]:
    """The tokens that stand for one byte each: GPT-2's table's characters, or "<0xHH>"."""
    if _byte_level(tokenizer):
        from oasiskv.cluster.logprobs import _bytes_to_unicode

        pieces = _bytes_to_unicode().values()
    else:
        pieces = [f"<0x{b:02X}>" for b in range(256)]
    return [i for i in map(tokenizer.token_to_id, pieces) if i is not None]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 40)))


def _end(tokenizer) -> int:
    """A token that completes nothing and leaves nothing unfinished: "." ."""
    (end,) = tokenizer.encode(".", add_special_tokens=False)
    return end


def _outputs(tokenizer, rng: random.Random, n: int, random_ids: bool) -> list[list[int]]:
    """Outputs ending with ".", so that no character is left unfinished at the end."""
    outputs = []
    for _ in range(n):
        if random_ids:
            # Any token, single bytes, and the tokens of a text, mixed: parts of characters cut
            # off, completed by chance, or interrupted.
            text = iter(tokenizer.encode(_text(rng) * 3, add_special_tokens=False))
            ids = [rng.choice((lambda: rng.randrange(tokenizer.vocab_size), lambda: rng.choice(_byte_ids(tokenizer)),
                               lambda: next(text, 0)))() for _ in range(rng.randint(1, 30))]
            ids = [i for i in ids if tokenizer.id_to_token(i) is not None]
        else:
            ids = tokenizer.encode(_text(rng), add_special_tokens=False)
            if rng.random() < 0.3:  # a special token among them
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(_special_ids(tokenizer)))
        outputs.append(ids + [_end(tokenizer)])
    return outputs


def _entries(ids: list[int], rng: random.Random, tokenizer, k: int = 4) -> list[TokenLogprob]:
    """Each token with k alternatives: itself, the next token of the output, random ids."""
    entries = []
    for i, t in enumerate(ids):
        top = [t] + ([ids[i + 1]] if i + 1 < len(ids) else []) + [rng.randrange(tokenizer.vocab_size)
                                                                   for _ in range(k)]
        top = [a for a in dict.fromkeys(top) if tokenizer.id_to_token(a) is not None][:k]
        entries.append(TokenLogprob(t, -rng.random(), tuple((a, -rng.random()) for a in top)))
    return entries


def _batches(entries: list, rng: random.Random) -> list[list]:
    cuts = sorted(rng.sample(range(1, len(entries)), rng.randint(0, len(entries) - 1))) if len(entries) > 1 else []
    return [entries[a:b] for a, b in zip([0] + cuts, cuts + [len(entries)])]


def _formatter(tokenizer, skip: bool) -> LogprobFormatter:
    # skip_special_tokens=True is the default, as in a request.
    return LogprobFormatter(tokenizer) if skip else LogprobFormatter(tokenizer, skip_special_tokens=False)


def _completion(tokenizer, batches, skip: bool = True) -> dict:
    formatter = _formatter(tokenizer, skip)
    whole = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for batch in batches:
        for key, values in formatter.completion(batch).items():
            whole[key] += values
    return whole


def _chat(tokenizer, batches, skip: bool = True) -> list[dict]:
    formatter = _formatter(tokenizer, skip)
    return [item for batch in batches for item in formatter.chat(batch)["content"]]


def _server_text(tokenizer, ids: list[int], skip: bool) -> str:
    """The response text the server makes of `ids`: its `OutputText` and `visible_text`, fed one
    token at a time as the engine feeds them (no stop strings; the output ran to its length)."""
    output = OutputText(tokenizer, skip)
    params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip)
    for n in range(1, len(ids) + 1):
        text, _ = visible_text(output, ids[:n], params, None if n < len(ids) else "length", set())
    return text


@pytest.mark.parametrize("random_ids", [False, True], ids=["text", "random-ids"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_tokens_join_into_the_decoded_text_and_offsets_point_into_it(tokenizer, random_ids, skip):
    rng = random.Random(f"{random_ids}{skip}")
    whole = 0
    for ids in _outputs(tokenizer, rng, 60, random_ids):
        shaped = _completion(tokenizer, [_entries(ids, rng, tokenizer)], skip)
        tokens = shaped["tokens"]
        text = "".join(tokens)
        decoded = tokenizer.decode(ids, skip_special_tokens=skip)
        if "\ufffd" not in decoded or _byte_level(tokenizer):
            whole += 1
            assert text == decoded, (ids, tokens)
        # else a byte-fallback decoder spelled a run of bytes with an invalid sequence in it as
        # one U+FFFD per byte, the run's whole characters too; the output text keeps what it
        # showed of them instead, and so do the tokens.
        assert text == _server_text(tokenizer, ids, skip), (ids, tokens)
        assert shaped["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
        assert all(0 <= a <= b <= len(text) for a, b in zip(shaped["text_offset"], shaped["text_offset"][1:] + [len(text)]))
        for top, token, lp in zip(shaped["top_logprobs"], tokens, shaped["token_logprobs"]):
            assert top[token] == lp  # the token's own logprob under its key
    assert whole > 20 or (random_ids and not _byte_level(tokenizer))


@pytest.mark.parametrize("random_ids", [False, True], ids=["text", "random-ids"])
def test_chat_bytes_join_into_the_texts_utf8(tokenizer, random_ids):
    rng = random.Random(f"bytes{random_ids}")
    valid = 0
    for ids in _outputs(tokenizer, rng, 60, random_ids):
        content = _chat(tokenizer, [_entries(ids, rng, tokenizer)])
        text = "".join(c["token"] for c in content)
        data = bytes(b for c in content for b in c["bytes"])
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        if "\ufffd" in decoded:
            if _byte_level(tokenizer):
                # Bytes that are not UTF-8: the tokens' raw bytes, which the tokenizer decodes
                # into its text.
                assert data.decode("utf-8", "replace") == decoded, (ids, content)
            continue
        valid += 1
        assert text == decoded and data == decoded.encode(), (ids, content)
        for c in content:
            # A token that adds "" but has bytes holds parts of characters, never whole ones.
            if not c["token"] and c["bytes"]:
                with pytest.raises(UnicodeDecodeError):
                    bytes(c["bytes"]).decode()
    assert valid > 20 or random_ids


def test_streamed_in_batches_as_in_one(tokenizer):
    rng = random.Random("batches")
    for random_ids in (False, True):
        for ids in _outputs(tokenizer, rng, 30, random_ids):
            entries = _entries(ids, rng, tokenizer)
            batched = _completion(tokenizer, _batches(entries, rng))
            assert batched == _completion(tokenizer, [entries])
            assert "".join(batched["tokens"]) == _server_text(tokenizer, ids, True)
            chat = _chat(tokenizer, _batches(entries, rng))
            assert chat == _chat(tokenizer, [entries])
            assert [c["token"] for c in chat] == batched["tokens"]


def test_alternatives_are_what_they_would_add_there(tokenizer):
    """An alternative shows what the output would have shown had it been chosen: the same text
    and bytes as a run that took it (so one that completes a character shows the character)."""
    rng = random.Random("alternatives")
    completing = 0
    for ids in _outputs(tokenizer, rng, 25, random_ids=False):
        entries = _entries(ids, rng, tokenizer)
        chat = _chat(tokenizer, [entries])
        completion = _completion(tokenizer, [entries])
        for i, entry in enumerate(entries):
            for (alternative, lp), item in zip(entry.top, chat[i]["top_logprobs"]):
                taken = _chat(tokenizer, [[TokenLogprob(t, -1.0) for t in ids[:i] + [alternative]]])[-1]
                assert (item["token"], item["bytes"]) == (taken["token"], taken["bytes"])
                assert item["logprob"] == lp and item["token"] in completion["top_logprobs"][i]
                if i and item["token"] and not chat[i - 1]["token"] and chat[i - 1]["bytes"]:
                    completing += 1
                    # It completes the character the tokens before it started: whole, not U+FFFD.
                    before = tokenizer.decode(ids[:i] + [alternative], skip_special_tokens=True)
                    assert "\ufffd" in item["token"] or before.endswith(item["token"])
    assert completing > 0


def test_a_special_token_adds_its_text_only_when_kept():
    tokenizer = _model("smollm2-135m")
    ids = tokenizer.encode("日本", add_special_tokens=False) + [tokenizer.eos_token_id]
    for skip, expected in ((True, ""), (False, tokenizer.eos_token)):
        content = _chat(tokenizer, [[TokenLogprob(t, -1.0) for t in ids]], skip)
        assert content[-1]["token"] == expected and bytes(content[-1]["bytes"]) == expected.encode()
        assert "".join(c["token"] for c in content) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert bytes(b for c in content for b in c["bytes"]) == ("日本" + expected).encode()
