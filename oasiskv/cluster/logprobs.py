"""Token logprobs in the two OpenAI shapes: chat's `content` list and completions' parallel lists.

A token's text is what the tokenizer decodes it to alone, so a token that holds part of a
character reads as U+FFFD, as in vLLM; chat's `bytes` are that text's UTF-8 bytes.
"""

from __future__ import annotations

from ..models.sampling import TokenLogprob


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.text_offset = 0  # completions: where the next token's text starts in the output

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if len(self._texts) > 4096:  # one request's tokens and alternatives; bounded anyway
                self._texts.clear()
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}

    def completion(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self.text(e.token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            # As vLLM: the token itself and the alternatives. Tokens that decode alike (parts of
            # characters) share a key: the token's own logprob first, then each alternative's best.
            top = {text: e.logprob}
            for t, lp in e.top:
                top.setdefault(self.text(t), lp)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}
