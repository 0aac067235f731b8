"""Structured output on the single-process engine (SmolLM2-135M): the output keeps to its spec,
greedy and sampled; a speculative step's rows are limited as one token at a time would be; bad
specs are refused naming what is wrong."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from oasiskv.decode_node.speculative import Draft, verify
from oasiskv.models.sampling import SamplingParams, process_logits
from oasiskv.models.structured_output import GrammarState, check_spec

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}}}


def _generate(llm, prompt: str, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def test_greedy_output_keeps_to_each_kind_of_spec(smollm2_llm):
    person = _generate(smollm2_llm, "A person as JSON:", max_tokens=60, structured_outputs={"json": SCHEMA})
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), SCHEMA)
    assert isinstance(json.loads(_generate(smollm2_llm, "Point as JSON: ", max_tokens=60,
                                           structured_outputs={"json_object": True}).text), dict)
    assert re.fullmatch(r"\d{3}-\d{4}", _generate(smollm2_llm, "My number is", max_tokens=20,
                                                  structured_outputs={"regex": r"\d{3}-\d{4}"}).text)
    capital = _generate(smollm2_llm, "The capital of France is", max_tokens=10,
                        structured_outputs={"choice": ["London", "Paris", "a \"quoted\"\nline"]})
    assert capital.text == "Paris" and capital.finish_reason == "stop"
    assert _generate(smollm2_llm, "Is the sky green?", max_tokens=10,
                     structured_outputs={"grammar": 'root ::= "yes" | "no"'}).text in ("yes", "no")
    lark = 'start: answer "!"\n// a comment with ::= in it\nanswer: "yes" | "no"'  # Lark, as vLLM reads it
    assert _generate(smollm2_llm, "Is the sky green?", max_tokens=10,
                     structured_outputs={"grammar": lark}).text in ("yes!", "no!")
    # Free, the model writes no such number: the spec made the difference.
    assert not re.fullmatch(r"\d{3}-\d{4}", _generate(smollm2_llm, "My number is", max_tokens=20).text)


def test_sampled_outputs_keep_to_the_schema(smollm2_llm):
    """At temperature 1 the model wanders far from JSON on its own; every output that ends is
    valid, and the one cut by max_tokens is a prefix of valid JSON text."""
    outputs = smollm2_llm.generate(["Person:"] * 6, [SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                                                                    structured_outputs={"json": SCHEMA})
                                                     for seed in range(6)])
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert finished
    for output in finished:
        jsonschema.validate(json.loads(output.text), SCHEMA)
    for output in outputs:
        assert output.text.lstrip().startswith("{")


def test_a_speculative_steps_rows_are_limited_as_one_token_at_a_time(smollm2_llm):
    """Row i follows the drafts before it; after a draft the spec refuses, the rows repeat its
    own (verification stops there); the matcher is left where the output is."""
    tok = smollm2_llm.tokenizer
    vocab = smollm2_llm.model.config.vocab_size
    spec = {"choice": ["Paris is big", "Rome"]}
    words = tok.encode("Paris is big", add_special_tokens=False)
    state = GrammarState(spec, tok, vocab)
    first = state.next_token_bitmask([], [], 1)
    rows = state.next_token_bitmask([], words[:3], 4)
    assert torch.equal(rows[0], first[0])
    for i in range(1, 4):  # one token at a time: a fresh matcher given the output words[:i]
        alone = GrammarState(spec, tok, vocab)
        assert torch.equal(rows[i], alone.next_token_bitmask(words[:i], [], 1)[0])
    refused = state.next_token_bitmask([], [tok.encode(" the", add_special_tokens=False)[0], words[0]], 3)
    assert torch.equal(refused[1], refused[0]) and torch.equal(refused[2], refused[0])
    assert torch.equal(state.next_token_bitmask([], [], 1)[0], first[0])  # the drafts were rolled back
    # A drafted stop token (ignore_eos goes on past it) ends the spec: the row after it is free,
    # as one token at a time would have it.
    yes = tok.encode("yes", add_special_tokens=False)
    ended = GrammarState({"choice": ["yes"]}, tok, vocab).next_token_bitmask([], yes + [tok.eos_token_ids[0]], 2 + len(yes))
    assert (ended[-1] == -1).all() and not (ended[-2] == -1).all()
    limited = process_logits(torch.randn(3, vocab), SamplingParams(structured_outputs=spec), [], [], words[:2],
                             grammar=state)
    allowed = torch.isfinite(limited)
    rome = tok.encode("Rome", add_special_tokens=False)[0]
    assert all(allowed[i, words[i]] for i in range(3)) and allowed[0, rome] and not allowed[1, rome]
    assert (allowed.sum(dim=-1) < 20).all()


def test_an_output_that_goes_back_is_followed_back(smollm2_llm):
    """A draft model's drafts are its output until verification rejects them: the matcher goes
    back to where the new output parts from what it took, past a stop token too."""
    tok = smollm2_llm.tokenizer
    vocab = smollm2_llm.model.config.vocab_size
    spec = {"choice": ["Paris is big", "Paris is old"]}
    words = tok.encode("Paris is big", add_special_tokens=False)
    state = GrammarState(spec, tok, vocab)
    whole = words + [tok.eos_token_ids[0]]
    state.sync(whole)
    assert state.finished
    for output in (words[:1], words[:2] + tok.encode(" old", add_special_tokens=False), words[:2], []):
        fresh = GrammarState(spec, tok, vocab)
        assert torch.equal(state.next_token_bitmask(output, [], 1), fresh.next_token_bitmask(output, [], 1)), output
    assert not state.finished


def test_a_spec_left_with_no_token_by_other_bans_is_refused_by_name(smollm2_llm):
    """allowed_token_ids that the spec never allows leave no token at all: sampling from none
    failed the whole step, and a token taken anyway would break the spec."""
    tok = smollm2_llm.tokenizer
    other = tok.encode(" banana", add_special_tokens=False)[0]
    vocab = smollm2_llm.model.config.vocab_size
    params = SamplingParams(max_tokens=10, allowed_token_ids=[other], structured_outputs={"choice": ["London", "Paris"]})
    with pytest.raises(ValueError, match="leaves no token to generate at output position 0"):
        process_logits(torch.randn(1, vocab), params, [], [], grammar=GrammarState(params.structured_outputs, tok, vocab))


def test_a_finished_spec_limits_nothing(smollm2_llm):
    """After the spec is complete and a stop token taken (ignore_eos goes on), the output is free
    text, as in vLLM."""
    out = _generate(smollm2_llm, "Answer yes or no:", max_tokens=12, ignore_eos=True,
                    structured_outputs={"choice": ["yes"]})
    assert out.text.startswith("yes") and len(out.token_ids) == 12
    eos = set(smollm2_llm.eos_token_ids)
    assert any(t not in eos for t in out.token_ids[2:]), out.token_ids  # not EOS over and over


def test_an_output_that_breaks_the_spec_is_named(smollm2_llm):
    tok = smollm2_llm.tokenizer
    state = GrammarState({"choice": ["Paris"]}, tok, smollm2_llm.model.config.vocab_size)
    with pytest.raises(ValueError, match="output token .* does not follow the request's structured_outputs"):
        state.sync(tok.encode("Rome", add_special_tokens=False))


@pytest.mark.parametrize("spec, fragment", [
    ({"json": {"type": "nonsense"}}, 'structured_outputs json is not valid: Unsupported type "nonsense"'),
    ({"json": "{not json"}, "structured_outputs json is not valid: Failed to parse JSON"),
    ({"regex": "(ab"}, "structured_outputs regex is not valid: Regex parsing error"),
    ({"grammar": "root ::= "}, "structured_outputs grammar is not valid: EBNF parser error"),
    ({"grammar": "start: (("}, "structured_outputs grammar is not valid"),
    ({"choice": []}, "choice must be a non-empty list of non-empty strings"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list of non-empty strings"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"regex": "a", "choice": ["a"]}, "must name exactly one of json, json_object, regex, choice, grammar"),
    ({"regex": "a", "json_object": False}, "must name exactly one of"),  # as vLLM: false names it too
    ({}, "got none"),
    ({"lark": "start: x"}, "'lark' is not supported"),
    ("json", "must be an object naming one of"),
])
def test_bad_specs_are_refused_naming_the_problem(spec, fragment):
    with pytest.raises(ValueError) as refused:
        check_spec(spec)
    assert fragment in str(refused.value)


def test_sampling_params_check_the_shape_and_the_engine_parses(smollm2_llm):
    """SamplingParams refuses a spec of the wrong shape at once; parsing (a large schema takes a
    while) is left to where it is compiled, which refuses one that does not parse."""
    with pytest.raises(ValueError, match="must name exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    params = SamplingParams(structured_outputs={"regex": "(ab"})
    with pytest.raises(ValueError, match="structured_outputs regex is not valid: Regex parsing error"):
        smollm2_llm.add_request("hi", params)
    assert not smollm2_llm.has_unfinished


@pytest.mark.parametrize("schema, fragment", [
    ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, "allOf with more than one schema"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]+", "maxLength": 3}}},
     "a pattern or format with minLength or maxLength"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
])
def test_schema_constraints_xgrammar_would_ignore_are_refused(schema, fragment):
    """Compiled, they were dropped: the output broke the schema ("maybe" for an enum in allOf)."""
    with pytest.raises(ValueError, match="which is not enforced") as refused:
        check_spec({"json": schema})
    assert fragment in str(refused.value)


def test_a_deeply_nested_schema_is_refused_before_it_is_parsed():
    """vLLM's limit of 64 levels: parsing 600 took 10 s."""
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    began = time.monotonic()
    for spec in ({"json": deep}, {"json": json.dumps(deep)}, {"json": "[" * 5000 + "]" * 5000}):
        with pytest.raises(ValueError, match="nests objects and arrays deeper than 64 levels"):
            check_spec(spec)
    assert time.monotonic() - began < 1.0
    check_spec({"json": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}})


def test_a_spec_with_a_dead_end_fails_its_request_not_the_batch(smollm2_llm):
    """A regex that parses but allows nothing after "a": the row left without a token raises
    ValueError naming the position (sampling from it failed the whole step)."""
    spec = {"regex": "a[^\\x00-\\U0010FFFF]"}
    state = GrammarState(spec, smollm2_llm.tokenizer, smollm2_llm.model.config.vocab_size)
    a = smollm2_llm.tokenizer.encode("a", add_special_tokens=False)
    with pytest.raises(ValueError, match="leaves no token to generate at output position 1"):
        process_logits(torch.randn(1, smollm2_llm.model.config.vocab_size), SamplingParams(structured_outputs=spec),
                       [], a, grammar=state)
    # In the single-process engine it ends alone, sampled beside a free request.
    dead, free = smollm2_llm.generate(["Say a", "Say a"], [
        SamplingParams(max_tokens=8, temperature=1.0, seed=1, structured_outputs=spec), SamplingParams(max_tokens=8)])
    assert dead.finish_reason == "error" and dead.token_ids == a
    assert free.token_ids == smollm2_llm.generate(["Say a"], SamplingParams(max_tokens=8))[0].token_ids
    # In a verification step the rows end before a later row left without a token: the rows
    # before it are as one token at a time has them ("a" stays possible), and verification checks
    # fewer drafts; if it takes "a", the next step's first row fails, as one token at a time would.
    spec = {"regex": "a[^\\x00-\\U0010FFFF]|b"}
    state = GrammarState(spec, smollm2_llm.tokenizer, smollm2_llm.model.config.vocab_size)
    b = smollm2_llm.tokenizer.encode("b", add_special_tokens=False)
    logits = torch.full((2, smollm2_llm.model.config.vocab_size), -5.0)
    logits[0, a[0]] = 5.0
    params = SamplingParams(structured_outputs=spec)
    rows = process_logits(logits, params, [], [], a, grammar=state)
    assert rows.shape[0] == 1 and torch.isfinite(rows[0, a[0]]) and torch.isfinite(rows[0, b[0]])
    assert verify(rows, Draft(a).first(rows.shape[0] - 1), params) == a
    with pytest.raises(ValueError, match="leaves no token to generate at output position 1"):
        process_logits(logits[:1], params, [], a, grammar=state)
    assert process_logits(logits, params, [], [], b, grammar=state).shape[0] == 2  # "b" ends it: EOS may follow


def test_stop_token_ids_are_the_specs_stop_tokens_too(smollm2_llm):
    """As vLLM gives its matcher: a request's stop token may come only where the spec may end (a
    newline stop id ended a JSON object right after its "{"; JSON's whitespace allows a newline
    there)."""
    tok, vocab = smollm2_llm.tokenizer, smollm2_llm.model.config.vocab_size
    newline = tok.encode("\n", add_special_tokens=False)[0]
    params = SamplingParams(stop_token_ids=[newline], structured_outputs={"json_object": True})
    opened, closed = tok.encode("{", add_special_tokens=False), tok.encode("{}", add_special_tokens=False)

    def allowed(state, output) -> bool:
        return bool(torch.isfinite(process_logits(torch.zeros(1, vocab), params, [], output, grammar=state)[0, newline]))

    assert allowed(GrammarState({"json_object": True}, tok, vocab), opened)  # as whitespace, without the stop
    with_stop = GrammarState.for_params(params, tok, vocab, smollm2_llm.eos_token_ids)
    assert not allowed(with_stop, opened) and allowed(with_stop, closed)


def test_a_refusal_names_the_field_the_spec_came_from():
    with pytest.raises(ValueError, match=r"^response_format json is not valid"):
        check_spec({"json": {"type": "nonsense"}}, "response_format")


def test_an_engine_without_a_tokenizer_says_so():
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        GrammarState({"regex": "a"}, None, 100)


def test_a_checked_spec_is_not_checked_again(monkeypatch):
    """A request's spec passes the API, its SamplingParams and each engine: the scans run once."""
    from oasiskv.models import structured_output

    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}}
    checked = check_spec({"json": json.dumps(schema)}, parse=False)
    assert checked == {"json": json.dumps(schema)}
    scans = []
    monkeypatch.setattr(structured_output, "_unsupported_json_feature", lambda s: scans.append(s))
    assert SamplingParams(structured_outputs=checked).structured_outputs is checked and check_spec(checked) is checked
    assert scans == []
    check_spec({"json": schema})
    assert scans == [schema]
