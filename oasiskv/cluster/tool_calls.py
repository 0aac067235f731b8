"""Tool calls (OpenAI's function calling), as vLLM serves them with its hermes parser, which is
Qwen2.5's format: the chat template writes the tools into the prompt, and the model calls one by
writing <tool_call>{"name": ..., "arguments": {...}}</tool_call> in its reply.

`tool_choice`: "none" (a text reply; the tools are still shown to the model, as vLLM shows
them), "auto" (the default when tools are given: calls are parsed out of the reply), "required"
(the reply is limited by structured output to a JSON array of calls) or a named function (the
reply is limited to that function's arguments).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

from ..models.structured_output import check_spec

log = logging.getLogger(__name__)

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# A call between the tags, or one the reply ended inside (cut by max_tokens), as vLLM reads them.
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END) + "|"
                        + re.escape(TOOL_CALL_START) + r"(.*)", re.DOTALL)
_CHOICE_USAGE = ('give "none", "auto", "required" or {"type": "function", "function": {"name": ...}} naming '
                 "one of `tools`")


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function, when named

    @property
    def parses_reply(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def check_tools(tools) -> list[dict]:
    """`tools` as OpenAI's function tools: [{"type": "function", "function": {"name": ...,
    "description": ..., "parameters": {JSON schema}}}]. ValueError naming the entry at fault."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {tools!r}")
    if not tools:  # as OpenAI and vLLM
        raise ValueError("tools must not be an empty array: give at least one tool or omit the field")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}} (only function tools are "
                             f"served), got {tool!r}")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}.function must be an object with a non-empty 'name'")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        if function["name"] in names:
            raise ValueError(f"{where}.function.name {function['name']!r} is given twice")
        names.add(function["name"])
    return tools


def normalized_tools(tools: list[dict]) -> list[dict]:
    """The tools as the chat template is shown them: vLLM's fields, in its order, unset ones as
    null and unknown ones dropped, so the prompt (and its token count) is vLLM's."""
    shown = []
    for tool in tools:
        function = tool["function"]
        described = {"name": function["name"], "description": function.get("description"),
                     "parameters": function.get("parameters")}
        if function.get("strict") is not None:
            described["strict"] = function["strict"]
        shown.append({"type": "function", "function": described})
    return shown


def resolve_tool_choice(tools: list[dict] | None, tool_choice) -> ToolChoice:
    """vLLM's rules: "auto" when tools are given and no choice is, "none" without tools; any other
    choice needs tools, and a named one must be among them. ValueError saying what is wrong."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if not tools:
        raise ValueError("tool_choice needs tools: when using tool_choice, tools must be set")
    if tool_choice in ("auto", "required"):
        return ToolChoice(tool_choice)
    if not isinstance(tool_choice, dict) or tool_choice.get("type", "function") != "function":
        raise ValueError(f"tool_choice {tool_choice!r} is not valid: {_CHOICE_USAGE}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_choice must name its function: {_CHOICE_USAGE}")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ValueError(f"tool_choice names {name!r}, which does not match any of the specified tools")
    return ToolChoice("named", name)


def _parameters(tool: dict) -> dict:
    # Missing or empty parameters still make the arguments a JSON object, as in vLLM.
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_spec(choice: ToolChoice, tools: list[dict], parallel_tool_calls: bool | None) -> dict | None:
    """The structured output that makes the reply a call: for a named function its parameters'
    schema; for "required" a JSON array of {"name", "parameters"} objects, one of them at least
    (at most one when parallel_tool_calls is false), as vLLM builds it. None: the reply is free.
    ValueError for a schema structured output cannot enforce (`check_spec`'s, naming `tools`)."""
    if choice.mode == "named":
        schema = _parameters(next(tool for tool in tools if tool["function"]["name"] == choice.name))
    elif choice.mode == "required":
        # Each tool's $defs move to the array's root, where its $refs ("#/$defs/...") point:
        # pydantic's schemas of nested models have them.
        definitions, alternatives = {}, []
        for tool in tools:
            parameters = dict(_parameters(tool))
            defs = parameters.pop("$defs", {})
            if not isinstance(defs, dict):
                raise ValueError(f"tools: the $defs of {tool['function']['name']!r} must be an object")
            for name, definition in defs.items():
                if definitions.setdefault(name, definition) != definition:
                    raise ValueError(f"tools: the definition {name!r} has several schemas, which is not supported")
            alternatives.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                "parameters": parameters},
                                 "required": ["name", "parameters"]})
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        if definitions:
            schema["$defs"] = definitions
    else:
        return None
    return check_spec({"json": schema}, "tools", parse=False)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates take them: an assistant's tool call arguments as an object
    (OpenAI sends JSON text; Qwen's template writes them with tojson), as vLLM passes them. Ones
    that are not a JSON object (a call cut short by max_tokens, say) are passed as {}, as vLLM
    does: refusing them would refuse every later turn of the conversation."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            message = {**message, "tool_calls": [dict(call) for call in calls]}
            for call in message["tool_calls"]:
                call["function"] = {**call["function"], "arguments": _arguments_object(call["function"])}
        elif "tool_calls" in message:
            message = {key: value for key, value in message.items() if key != "tool_calls"}  # [] as none, as vLLM
        out.append(message)
    return out


def _arguments_object(function: dict) -> dict:
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            log.warning("tool call %r: its arguments (%d characters) are not JSON; the template is given {}",
                        function.get("name"), len(function["arguments"]))
            return {}
    if not isinstance(arguments, dict):
        if arguments not in (None, ""):
            log.warning("tool call %r: its arguments are a JSON %s, not an object; the template is given {}",
                        function.get("name"), type(arguments).__name__)
        return {}
    return arguments


def _call(entry, arguments_key: str) -> ToolCall | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or arguments_key not in entry:
        return None
    return ToolCall(entry["name"], json.dumps(entry[arguments_key], ensure_ascii=False), new_tool_call_id())


def parse_reply(choice: ToolChoice, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """The reply's content and the calls in it (the first only, when not `parallel`, as vLLM
    filters them). A reply that does not parse as the calls it should hold (cut short by
    max_tokens, say) is content, with no calls, as vLLM returns it."""
    content, calls = _parsed(choice, text)
    return content, calls if parallel else calls[:1]


def _parsed(choice: ToolChoice, text: str) -> tuple[str | None, list[ToolCall]]:
    if choice.mode == "named":
        return "", [ToolCall(choice.name, text, new_tool_call_id())]
    try:
        if choice.mode == "required":
            entries = json.loads(text)
            calls = [_call(entry, "parameters") for entry in entries] if isinstance(entries, list) else [None]
            return ("", calls) if calls and None not in calls else (text, [])
        if choice.mode != "auto" or TOOL_CALL_START not in text:
            return text, []
        calls = [_call(json.loads(between or unended), "arguments") for between, unended in _TOOL_CALL.findall(text)]
    except (ValueError, RecursionError):  # not JSON, or nested past Python's limit
        return text, []
    if None in calls:
        return text, []
    before = text[: text.find(TOOL_CALL_START)]
    return (before if before.strip() else None), calls  # as vLLM: whitespace alone is no content


def finish_reason(choice: ToolChoice, calls: list[ToolCall], reason: str | None) -> str | None:
    """As vLLM (and OpenAI): "tool_calls" when "auto" called a tool, or "required" ended at a stop;
    a named call keeps its reason ("stop")."""
    if (choice.mode == "auto" and calls) or (choice.mode == "required" and calls and reason == "stop"):
        return "tool_calls"
    return reason


class ToolCallStream:
    """One streamed choice's reply, split into the content to send now and tool-call deltas. A
    named call streams its arguments as they come; "auto" streams content until a call begins
    (holding back what may be the start of its tag) and sends the calls when the reply ends, as
    does "required"."""

    def __init__(self, choice: ToolChoice, parallel: bool = True):
        self.choice = choice
        self.parallel = parallel
        self.text = ""
        self._sent = 0  # how much of `text` went out as content (or as a named call's arguments)
        self._named_id: str | None = None
        self._in_call = False  # "auto": a call began, and the rest is held for parsing
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if self.choice.mode == "named":
            return "", self._named_arguments()
        if self.choice.mode != "auto" or self._in_call:
            return "", []
        start = self.text.find(TOOL_CALL_START, max(0, self._sent - len(TOOL_CALL_START)))
        self._in_call = start >= 0
        end = start if self._in_call else len(self.text) - _partial_tag(self.text, TOOL_CALL_START)
        content, self._sent = self.text[self._sent : end], max(self._sent, end)
        return content, []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left to send when the reply has ended; `calls` then holds its calls."""
        if self.choice.mode == "named":
            deltas = self._named_arguments(final=True)
            self.calls = [ToolCall(self.choice.name, self.text, self._named_id)]
            return "", deltas
        content, self.calls = parse_reply(self.choice, self.text, self.parallel)
        if not self.calls:
            rest, self._sent = self.text[self._sent :], len(self.text)
            return rest, []
        deltas = [{"index": i, **call.to_openai()} for i, call in enumerate(self.calls)]
        return "", deltas

    def _named_arguments(self, final: bool = False) -> list[dict]:
        new, self._sent = self.text[self._sent :], len(self.text)
        if self._named_id is None:
            if not new and not final:
                return []
            self._named_id = new_tool_call_id()
            return [{"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.choice.name, "arguments": new}}]
        return [{"index": 0, "function": {"arguments": new}}] if new else []


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters are the start of `tag` (held back: the tag may be
    coming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
