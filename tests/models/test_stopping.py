"""The text a running request shows only ever grows, so a stream can send the difference."""

from __future__ import annotations

import random

import pytest

from oasiskv.models.engine.stopping import OutputText, _stop_prefix_at_end, stop_reason, visible_text
from oasiskv.models.sampling import SamplingParams

EOS = {0}


@pytest.fixture(scope="module")
def tokenizer(smollm2_llm):
    return smollm2_llm.tokenizer


def _texts_while_running(tokenizer, ids, params):
    return [visible_text(tokenizer, ids[:n], params, None, EOS)[0] for n in range(1, len(ids) + 1)]


def test_a_character_split_across_tokens_is_held_back_until_it_is_whole(tokenizer):
    text = "进行的天气很好😀 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) - 5  # byte-level tokens: several characters take more than one
    shown = _texts_while_running(tokenizer, ids, SamplingParams())
    split = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))  # the case exists
    for before, after in zip(shown, shown[1:]):
        assert after.startswith(before) and "\ufffd" not in after
    assert shown[-1] == text
    # Finished, a character the output ended inside is left out, as vLLM leaves it out (its
    # incremental detokenizer never emits a text ending in U+FFFD, and nothing flushes it).
    cut, reason = visible_text(tokenizer, ids[:split], SamplingParams(), "length", EOS)
    whole = tokenizer.decode(ids[:split])
    assert reason == "length" and whole.endswith("\ufffd") and cut == whole.rstrip("\ufffd") == shown[split - 1]
    assert visible_text(tokenizer, ids[:split] + [0], SamplingParams(), "stop", EOS) == (cut, "stop")


def test_an_ending_that_may_grow_into_a_stop_string_is_held_back(tokenizer):
    params = SamplingParams(stop=["\n\nEND"])
    ids = tokenizer.encode("alpha beta\n\nEND gamma")
    shown = _texts_while_running(tokenizer, ids, params)
    finished_at = next(n for n in range(1, len(ids) + 1)
                       if visible_text(tokenizer, ids[:n], params, None, EOS)[1] == "stop")
    for before, after in zip(shown[: finished_at - 1], shown[1:finished_at]):
        assert after.startswith(before)
    final, reason = visible_text(tokenizer, ids[:finished_at], params, None, EOS)
    assert (final, reason) == ("alpha beta", "stop")
    assert all(final.startswith(s) for s in shown[: finished_at - 1])  # nothing shown was taken back


def test_the_longest_stop_prefix_at_the_end_by_its_definition():
    rng = random.Random(3)
    for _ in range(5000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 9)))
        stop = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 7)))
        expected = max((n for n in range(1, len(stop)) if n <= len(text) and text.endswith(stop[:n])), default=0)
        assert _stop_prefix_at_end(text, stop) == expected, (text, stop)


def test_the_incremental_decode_equals_the_whole_decode(tokenizer):
    """Steps add one to four tokens; ids from the text (multi-byte characters, spaces, newlines)
    and random ids (special tokens, stray UTF-8 bytes)."""
    rng = random.Random(11)
    text_ids = tokenizer.encode("def f(x):\n    return x  # 进行的天气 😀 émigré — 日本語\n\n\tend ")
    for trial in range(20):
        ids = text_ids if trial % 2 == 0 else [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
        output, n = OutputText(tokenizer), 0
        while n < len(ids):
            n = min(len(ids), n + rng.randrange(1, 5))
            assert output.decode(ids[:n]) == tokenizer.decode(ids[:n])
    restarted = OutputText(tokenizer)
    restarted.decode(text_ids)
    assert restarted.decode(text_ids[:3]) == tokenizer.decode(text_ids[:3])  # shorter ids start it over


def test_a_stop_string_is_kept_when_asked_for(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma")
    for include, expected in ((False, "alpha beta "), (True, "alpha beta STOP")):
        params = SamplingParams(stop=["STOP", "gamma"], include_stop_str_in_output=include)
        assert visible_text(tokenizer, ids, params, None, EOS) == (expected, "stop")


def test_the_stop_token_that_ended_the_output_is_left_out_unless_asked_for(tokenizer):
    """As vLLM: the text of a stop_token_ids token (or an EOS kept by skip_special_tokens=False)
    that ended the output is not in it; include_stop_str_in_output keeps it."""
    ids = tokenizer.encode("alpha beta.")
    period, im_end = ids[-1], tokenizer.token_to_id("<|im_end|>")
    for include, expected in ((False, "alpha beta"), (True, "alpha beta.")):
        params = SamplingParams(stop_token_ids=[period], include_stop_str_in_output=include)
        assert visible_text(tokenizer, ids, params, "stop", EOS) == (expected, "stop")
    for include, expected in ((False, "alpha beta."), (True, "alpha beta.<|im_end|>")):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        assert visible_text(OutputText(tokenizer, False), ids + [im_end], params, "stop", {im_end}) == (expected, "stop")
    # Not the end of the output (it ran to max_tokens): the token's text stays.
    assert visible_text(tokenizer, ids, SamplingParams(stop_token_ids=[period]), "length", EOS)[0] == "alpha beta."


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(tokenizer):
    """An EOS kept by ignore_eos showed as '<|im_end|>' in the text; vLLM leaves it out."""
    special = tokenizer.token_to_id("<|im_end|>")
    assert special is not None
    ids = tokenizer.encode("one two") + [special] + tokenizer.encode(" three")
    for skip, expected in ((True, "one two three"), (False, "one two<|im_end|> three")):
        params = SamplingParams(ignore_eos=True, skip_special_tokens=skip)
        assert visible_text(OutputText(tokenizer, skip), ids, params, "length", EOS)[0] == expected


def test_text_that_is_not_valid_unicode_is_refused_by_name(tokenizer):
    """A command-line prompt with bytes that are not UTF-8 arrives with surrogate escapes;
    tokenizers raised a bare TypeError."""
    with pytest.raises(ValueError, match=r"not valid Unicode: '\\udcff' at character 0"):
        tokenizer.encode("\udcff abc")


def test_min_tokens_keeps_a_stop_string_from_ending_the_output_early(tokenizer):
    """As vLLM: a stop string counts once it ends in the text after the first min_tokens tokens;
    the earlier one is output, the next one ends it. Decoded whole or a step at a time."""
    ids = tokenizer.encode("alpha STOP beta STOP gamma")
    first = next(n for n in range(1, len(ids)) if "STOP" in tokenizer.decode(ids[:n]))  # the token ending it
    params = SamplingParams(stop=["STOP"], min_tokens=first)
    for decoder in (tokenizer, OutputText(tokenizer)):
        shown = [visible_text(decoder, ids[:n], params, None, EOS) for n in range(1, len(ids) + 1)]
        finished_at = next(n for n, (_, reason) in enumerate(shown, 1) if reason == "stop")
        assert finished_at > first + 1 and shown[finished_at - 1] == ("alpha STOP beta ", "stop")
    assert visible_text(tokenizer, ids, SamplingParams(stop=["STOP"], min_tokens=first - 1), None, EOS) == ("alpha ", "stop")


def test_a_stop_string_ending_after_min_tokens_counts_though_it_began_before(tokenizer):
    ids = tokenizer.encode("alpha STOP beta")
    first = next(n for n in range(1, len(ids)) if "STOP" in tokenizer.decode(ids[:n]))
    assert tokenizer.decode(ids[: first - 1]).startswith("alpha S")  # "STOP" begins in the first min_tokens
    params = SamplingParams(stop=["STOP"], min_tokens=first - 1)
    assert visible_text(OutputText(tokenizer), ids[:first], params, None, EOS) == ("alpha ", "stop")


def test_eos_and_stop_tokens_do_not_end_the_output_before_min_tokens():
    from oasiskv.models.engine.stopping import finish_reason

    params = SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=10)
    assert [finish_reason(token, n, params, EOS, False) for token in (0, 7) for n in (1, 3, 4)] == [
        None, None, "stop", None, None, "stop"]


def _byte_fallback_tokenizer():
    """A tokenizer that spells characters it has no token for as byte tokens and decodes a run
    of them together, as Gemma's does (the `tokenizers` library's own ByteFallback decoder)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{i:02X}>": i for i in range(256)} | {"a": 256, "b": 257}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def test_a_byte_fallback_decoder_never_takes_a_shown_character_back():
    """Once the next character's first byte joins the run, the decoder turns the whole run, the
    finished character before it too, into U+FFFD: the shown text went from 'a𝔫' back to 'a',
    and a stream that sends each text's growth sent '𝔫' twice."""
    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode("a𝔫𝔦b").ids
    assert len(ids) == 10 and tokenizer.decode(ids[:6]) == "a" + "\ufffd" * 5  # the decoder's own behaviour
    output, streamed, shown = OutputText(tokenizer), "", ""
    for n in range(1, len(ids) + 1):
        text, _ = visible_text(output, ids[:n], SamplingParams(), None, EOS)
        assert text.startswith(shown), (n, shown, text)
        streamed += text[len(shown):]
        shown = text
    assert streamed == shown == "a𝔫𝔦b" == tokenizer.decode(ids)
    # An output that ends inside a character shows the characters that were whole.
    output = OutputText(tokenizer)
    for n in range(1, 7):
        visible_text(output, ids[:n], SamplingParams(), None, EOS)
    assert visible_text(output, ids[:7], SamplingParams(), "length", EOS) == ("a𝔫", "length")


def test_a_character_that_never_finishes_does_not_take_back_the_one_before_it():
    """A stray first byte, then a whole token: the decoder spells the whole run, the finished
    '𝔫' too, as U+FFFD for good. The text goes on from what it showed."""
    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode("a𝔫").ids + [0xF0] + tokenizer.encode("b").ids
    assert tokenizer.decode(ids) == "a" + "\ufffd" * 5 + "b"
    output, shown = OutputText(tokenizer), ""
    for n in range(1, len(ids)):
        text, _ = visible_text(output, ids[:n], SamplingParams(), None, EOS)
        assert text.startswith(shown)
        shown = text
    assert shown == "a𝔫"
    assert visible_text(output, ids, SamplingParams(), "length", EOS) == ("a𝔫\ufffdb", "length")


def test_the_stop_reason_names_what_ended_the_output_as_vllm_does(tokenizer):
    """vLLM's `stop_reason`: the stop string that matched (the first in the text), the
    stop_token_ids id, or None for an EOS (even one also listed in stop_token_ids)."""
    ids = tokenizer.encode("alpha beta STOP gamma")
    assert stop_reason(tokenizer, ids, SamplingParams(stop=["gamma", "STOP"]), EOS) == "STOP"
    assert stop_reason(tokenizer, ids, SamplingParams(stop_token_ids=[ids[-1]]), EOS) == ids[-1]
    assert stop_reason(tokenizer, ids + [0], SamplingParams(stop=["STOP"]), EOS) is None
    assert stop_reason(tokenizer, ids + [0], SamplingParams(stop_token_ids=[0]), EOS) is None
    assert stop_reason(tokenizer, ids + [0], SamplingParams(stop_token_ids=[0], ignore_eos=True), EOS) == 0
    # A stop string inside the first min_tokens tokens does not count, as in visible_text.
    assert stop_reason(tokenizer, ids, SamplingParams(stop=["alpha"], min_tokens=2, max_tokens=16), EOS) is None
