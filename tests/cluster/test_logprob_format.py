"""The OpenAI shapes of token logprobs, with a stand-in tokenizer whose tokens may decode alike
(as the parts of one character do)."""

from __future__ import annotations

from oasiskv.cluster.logprobs import LogprobFormatter
from oasiskv.models.sampling import TokenLogprob


class _Tokenizer:
    texts = {1: "\ufffd", 2: "\ufffd", 3: "\ufffd", 4: " a", 5: "b"}

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)


def test_completion_top_logprobs_keep_the_tokens_own_logprob_when_texts_collide():
    entries = [TokenLogprob(2, -1.4, ((1, -1.0), (2, -1.4), (3, -2.0))), TokenLogprob(4, -0.5, ((5, -0.2), (4, -0.5)))]
    shaped = LogprobFormatter(_Tokenizer()).completion(entries)
    assert shaped["token_logprobs"] == [-1.4, -0.5]
    # The key of the sampled token carries its own logprob (it carried the least likely alike's).
    assert shaped["top_logprobs"] == [{"\ufffd": -1.4}, {" a": -0.5, "b": -0.2}]
    assert shaped["tokens"] == ["\ufffd", " a"] and shaped["text_offset"] == [0, 1]


def test_chat_logprobs_list_every_alternative_with_its_bytes():
    entries = [TokenLogprob(4, -0.5, ((5, -0.2), (4, -0.5)))]
    (item,) = LogprobFormatter(_Tokenizer()).chat(entries)["content"]
    assert item == {"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": [
        {"token": "b", "logprob": -0.2, "bytes": [98]}, {"token": " a", "logprob": -0.5, "bytes": [32, 97]}]}
