"""Tool calls as vLLM's hermes parser reads them (Qwen2.5's format), streamed and whole, and the
structured output that makes a required or named call. (Qwen2.5-Coder-0.5B, shown the tools,
answered with the call's JSON without the tags, which vLLM's parser, and this one, read as text.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from oasiskv.cluster.tool_calls import (
    ToolCallStream,
    check_tools,
    finish_reason,
    normalized_tools,
    parse_reply,
    resolve_tool_choice,
    template_messages,
    tool_spec,
)
from oasiskv.models.structured_output import GrammarState

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
CALLING = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(choice, text: str, piece: int) -> tuple[str, list[dict], list[str]]:
    """The content and tool-call deltas a stream sends for `text` arriving `piece` characters
    at a time, and the calls' ids."""
    stream = ToolCallStream(choice)
    content, deltas = "", []
    for at in range(0, len(text), piece):
        sent, calls = stream.feed(text[at : at + piece])
        content, deltas = content + sent, deltas + calls
    sent, calls = stream.finish()
    return content + sent, deltas + calls, [call.id for call in stream.calls]


def test_auto_parses_the_calls_out_of_the_reply_and_keeps_the_text_before_them():
    auto = resolve_tool_choice(TOOLS, None)
    assert auto.mode == "auto"
    content, calls = parse_reply(auto, CALLING + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert finish_reason(auto, calls, "stop") == "tool_calls" and finish_reason(auto, [], "stop") == "stop"
    # A call that is not JSON, or has no name, leaves the reply as text, as vLLM does.
    for broken in ("<tool_call>{\"name\": \"get_weather\", \"argu", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_reply(auto, broken) == (broken, [])
    assert parse_reply(auto, "Sunny.") == ("Sunny.", [])
    # One cut short by max_tokens after its JSON is still a call, as vLLM reads it.
    assert parse_reply(auto, CALLING[: -len("</tool_call>")])[1][0].name == "get_weather"


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_a_stream_sends_the_text_until_a_call_begins_then_the_calls(piece):
    auto = resolve_tool_choice(TOOLS, "auto")
    content, deltas, ids = streamed(auto, CALLING, piece)
    assert content == "Let me look.\n"  # nothing of "<tool_call>" leaked, however it was split
    assert deltas == [{"index": 0, "id": ids[0], "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    text = "a < b and <tool but no call"
    assert streamed(auto, text, piece)[:2] == (text, [])


@pytest.mark.parametrize("piece", [1, 5])
def test_a_named_call_streams_its_arguments_as_they_come(piece):
    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    arguments = '{"city": "Paris"}'
    content, deltas, ids = streamed(named, arguments, piece)
    assert content == "" and deltas[0]["id"] == ids[0] and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == arguments
    assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert parse_reply(named, arguments)[0] == "" and finish_reason(named, [object()], "stop") == "stop"


def test_required_and_named_calls_are_limited_by_the_schema_vllm_builds(smollm2_llm):
    required = resolve_tool_choice(TOOLS, "required")
    spec = tool_spec(required, TOOLS, parallel_tool_calls=False)
    schema = spec["json"]
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "get_rain", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "maxItems" not in tool_spec(required, TOOLS, None)["json"]
    content, calls = parse_reply(required, json.dumps(good))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert finish_reason(required, calls, "stop") == "tool_calls" and finish_reason(required, calls, "length") == "length"
    assert parse_reply(required, '[{"name": "get_wea') == ('[{"name": "get_wea', [])
    # The named tool without parameters gets an object, as in vLLM; both compile against a vocabulary.
    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert tool_spec(named, TOOLS, None) == {"json": {"type": "object", "properties": {}}}
    for one in (spec, tool_spec(named, TOOLS, None)):
        GrammarState(one, smollm2_llm.tokenizer, smollm2_llm.model.config.vocab_size)
    assert tool_spec(resolve_tool_choice(TOOLS, "auto"), TOOLS, None) is None


@pytest.mark.parametrize("tools, choice, fragment", [
    (None, "auto", "when using tool_choice, tools must be set"),
    (TOOLS, "sometimes", "tool_choice 'sometimes' is not valid"),
    (TOOLS, {"type": "function", "function": {"name": "get_rain"}}, "does not match any of the specified tools"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice must name its function"),
])
def test_a_tool_choice_that_cannot_be_honoured_is_refused(tools, choice, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_tool_choice(tools, choice)
    assert resolve_tool_choice(None, None).mode == "none" and resolve_tool_choice(None, "none").mode == "none"


@pytest.mark.parametrize("tools, fragment", [
    ({"name": "f"}, "tools must be a list"),
    ([], "tools must not be an empty array"),
    ([{"type": "retrieval"}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"description": "x"}}], r"tools\[0\].function must be an object with a"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": "x"}}], r"tools\[1\].function.parameters"),
    ([WEATHER, WEATHER], "'get_weather' is given twice"),
])
def test_malformed_tools_are_refused(tools, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_tools(tools)


def test_an_assistants_call_arguments_reach_the_template_as_an_object():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    shown = template_messages(messages)
    assert shown[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert call["function"]["arguments"] == '{"city": "Oslo"}'  # the request's own is left as it was
    assert "tool_calls" not in template_messages([{"role": "assistant", "content": "x", "tool_calls": []}])[0]
    # As vLLM: arguments that are not a JSON object's text (a call this server cut at max_tokens,
    # say) are given as {}; refusing them refused every later turn of the conversation.
    for arguments in ('{"city": "Par', "", None, "[1, 2]", "[" * 50_000, {"city": "Lima"}):
        shown = template_messages([{"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": arguments}}]}])
        assert shown[0]["tool_calls"][0]["function"]["arguments"] == (arguments if isinstance(arguments, dict) else {})


def test_the_template_is_shown_the_tools_as_vllm_shows_them():
    """vLLM's fields in its order, unset ones null, unknown ones dropped: the prompt, and its
    token count, are vLLM's."""
    shown = normalized_tools([TIME, {"type": "function", "x": 1, "function": {
        "strict": True, "parameters": {"type": "object"}, "name": "f", "extra": 2}}])
    assert shown == [{"type": "function", "function": {"name": "get_time", "description": None, "parameters": None}},
                     {"type": "function", "function": {"name": "f", "description": None,
                                                       "parameters": {"type": "object"}, "strict": True}}]
    assert [list(one["function"]) for one in shown] == [["name", "description", "parameters"],
                                                        ["name", "description", "parameters", "strict"]]


def test_parallel_tool_calls_false_keeps_the_first_call_and_odd_replies_stay_text():
    auto = resolve_tool_choice(TOOLS, "auto")
    two = CALLING + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert [c.name for c in parse_reply(auto, two, parallel=False)[1]] == ["get_weather"]
    assert streamed_first(auto, two) == ["get_weather"]
    deep = "<tool_call>" + "[" * 5000  # nested past Python's limit: a 500 before
    assert parse_reply(auto, deep) == (deep, [])
    assert parse_reply(resolve_tool_choice(TOOLS, "required"), "[" * 5000) == ("[" * 5000, [])
    assert parse_reply(auto, "\n" + CALLING[CALLING.index("<tool_call>"):])[0] is None  # whitespace is no content


def streamed_first(choice, text: str) -> list[str]:
    stream = ToolCallStream(choice, parallel=False)
    stream.feed(text)
    return [delta["function"]["name"] for delta in stream.finish()[1]]


def test_required_moves_each_tools_definitions_to_the_root_where_their_refs_point(smollm2_llm):
    """pydantic's schemas of nested models ($defs + $ref) were refused with a 400."""
    located = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}}
    spec = tool_spec(resolve_tool_choice([located, TIME], "required"), [located, TIME], None)
    assert set(spec["json"]["$defs"]) == {"Place"} and "$defs" not in spec["json"]["items"]["anyOf"][0]["properties"]
    jsonschema.validate([{"name": "locate", "parameters": {"where": {"city": "Oslo"}}}], spec["json"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "locate", "parameters": {"where": {"town": "Oslo"}}}], spec["json"])
    GrammarState(spec, smollm2_llm.tokenizer, smollm2_llm.model.config.vocab_size)
    clashing = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "$defs": {"Place": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="'Place' has several schemas"):
        tool_spec(resolve_tool_choice([located, clashing], "required"), [located, clashing], None)
