"""The OpenAI shapes of token logprobs: with a stand-in tokenizer for the shapes, and with
SmolLM2's tokenizer for the example that showed U+FFFD for the parts of a character (compared
with vLLM on the same weights)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from oasiskv.cluster.logprobs import EchoLogprobsGate, LogprobFormatter
from oasiskv.models.sampling import TokenLogprob

SMOLLM2 = Path(os.path.expanduser("~/.cache/oasiskv/models/smollm2-135m"))


class _Tokenizer:
    texts = {1: "x", 2: "y", 3: "z", 4: " a", 5: "b"}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.texts[i] for i in ids)


def test_completion_top_logprobs_keep_the_tokens_own_logprob_when_texts_collide():
    entries = [TokenLogprob(2, -1.4, ((1, -1.0), (2, -1.4), (3, -2.0))), TokenLogprob(4, -0.5, ((5, -0.2), (4, -0.5)))]
    shaped = LogprobFormatter(_Tokenizer()).completion(entries)
    assert shaped["token_logprobs"] == [-1.4, -0.5]
    assert shaped["top_logprobs"] == [{"y": -1.4, "x": -1.0, "z": -2.0}, {" a": -0.5, "b": -0.2}]
    assert shaped["tokens"] == ["y", " a"] and shaped["text_offset"] == [0, 1]


def test_chat_logprobs_list_every_alternative_with_its_bytes():
    entries = [TokenLogprob(4, -0.5, ((5, -0.2), (4, -0.5)))]
    (item,) = LogprobFormatter(_Tokenizer()).chat(entries)["content"]
    assert item == {"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": [
        {"token": "b", "logprob": -0.2, "bytes": [98]}, {"token": " a", "logprob": -0.5, "bytes": [32, 97]}]}


@pytest.fixture(scope="module")
def smollm2():
    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2's tokenizer is not in {SMOLLM2}")
    from oasiskv.models.tokenizer import load_tokenizer

    return load_tokenizer(SMOLLM2)


def _output_of_the_example(tokenizer) -> list[int]:
    # "日本の首都は" with max_tokens 6 wrote "、アニ" and the first bytes of a fourth character
    # (which the output text leaves out): "、" is one token, "ア" and "ニ" two each.
    ids = tokenizer.encode("、アニ")[:5] + tokenizer.encode("ア")[:1]
    assert tokenizer.decode(ids) == "、アニ\ufffd"
    return ids


def test_completion_tokens_are_what_each_adds_to_the_text(smollm2):
    ids = _output_of_the_example(smollm2)
    # Each part's alternatives: itself, and (at the second) the token that starts "ア" instead.
    entries = [TokenLogprob(t, -0.1 * i, ((t, -0.1 * i), (ids[1], -3.0))) for i, t in enumerate(ids)]
    shaped = LogprobFormatter(smollm2).completion(entries)
    # As vLLM gives them (it gave "\ufffd" for all five after "、", at offsets 1 to 5 in a
    # text of 3 characters).
    assert shaped["tokens"] == ["、", "", "ア", "", "ニ", ""]
    assert shaped["text_offset"] == [0, 1, 1, 2, 2, 3]
    # The tokens' own logprobs under their keys; where an alternative adds the same text, its
    # logprob does not replace the token's.
    assert [top[text] for top, text in zip(shaped["top_logprobs"], shaped["tokens"])] == shaped["token_logprobs"]
    # At "ア"'s second part, the token that starts "ア" would add "" (a new unfinished character).
    assert shaped["top_logprobs"][2] == {"ア": -0.2, "": -3.0}


def test_chat_bytes_rebuild_the_text(smollm2):
    ids = _output_of_the_example(smollm2)
    content = LogprobFormatter(smollm2).chat([TokenLogprob(t, -1.0) for t in ids])["content"]
    assert [c["token"] for c in content] == ["、", "", "ア", "", "ニ", ""]
    # ア's two tokens carry its bytes between them (vLLM: [] and all three), not U+FFFD's
    # [239, 191, 189] each.
    assert content[1]["bytes"] + content[2]["bytes"] == list("ア".encode())
    assert content[1]["bytes"] and content[2]["bytes"]
    assert bytes(b for c in content[:5] for b in c["bytes"]).decode() == "、アニ"
    json.dumps(content)  # plain lists of ints and strings


@dataclasses.dataclass
class _Event:  # the one field of a stream event that the gate reads
    name: str
    prompt_logprobs: list | None = None


def test_echo_gate_holds_a_siblings_events_until_its_prompts_logprobs_come_then_keeps_their_order():
    # Two prompts, n = 2: choices 0 and 1 echo prompt 0, choices 2 and 3 prompt 1.
    gate = EchoLogprobsGate([True] * 4, n=2)
    assert gate.passed(1, _Event("1a")) == []
    assert gate.passed(1, _Event("1b")) == []
    assert gate.passed(3, _Event("3a")) == []
    first = _Event("0a", prompt_logprobs=[TokenLogprob(7, -0.5)])
    assert [(i, e.name) for i, e in gate.passed(0, first)] == [(1, "1a"), (1, "1b"), (0, "0a")]
    assert gate.found == {0: first.prompt_logprobs}
    # Once its prompt's logprobs came, a choice passes at once; prompt 1 still waits.
    assert [(i, e.name) for i, e in gate.passed(1, _Event("1c"))] == [(1, "1c")]
    assert gate.passed(3, _Event("3b")) == []
    assert [(i, e.name) for i, e in gate.passed(2, _Event("2a", prompt_logprobs=[]))] == [(3, "3a"), (3, "3b"), (2, "2a")]


def test_echo_gate_passes_choices_that_wait_for_nothing():
    gate = EchoLogprobsGate([False, True], n=2)
    assert [i for i, _ in gate.passed(0, _Event("0a"))] == [0]
    assert gate.passed(1, _Event("1a")) == []
