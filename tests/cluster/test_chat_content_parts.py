"""Chat content given as text parts is one text, as vLLM renders it."""

from oasiskv.cluster.protocol import ChatMessage


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them():
    message = ChatMessage(role="user", content=[{"type": "text", "text": "first"}, {"type": "text", "text": "second"}])
    assert message.content == "first\nsecond"
    assert ChatMessage(role="user", content=[{"type": "text", "text": "only"}]).content == "only"
