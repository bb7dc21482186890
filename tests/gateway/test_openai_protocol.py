from __future__ import annotations

import json

import pytest

from gateway.api_error import MAX_MESSAGE_CHARS, APIError
from gateway.openai.body import MAX_BODY_BYTES, MAX_JSON_DEPTH, check_content_type
from gateway.openai.request import fit_to_context, parse_chat_request, parse_completion_request

MODELS = ("SmolLM2-135M-Instruct",)
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": MODELS[0], "messages": MESSAGES, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": MODELS[0], "prompt": "Once upon", **fields}).encode()


def error_of(parse, raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse(raw, MODELS)
    return info.value


def test_error_body_has_openais_shape():
    err = error_of(parse_chat_request, chat(temperature=-1))
    assert err.body() == {
        "error": {
            "message": "temperature must be in [0, 2], got -1.0",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }
    assert err.sse_event().startswith('data: {"error":{') and err.sse_event().endswith("}\n\n")


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"hi"', "must be a JSON object"),
    ],
)
def test_malformed_body_is_400(raw, message):
    for parse in (parse_chat_request, parse_completion_request):
        err = error_of(parse, raw)
        assert (err.status, err.type, err.param) == (400, "invalid_request_error", None)
        assert message in err.message


PREFIX = b'{"model": "SmolLM2-135M-Instruct", "prompt": '


@pytest.mark.parametrize(
    "raw, param, message",
    [
        (
            PREFIX + b"[" * 100_000 + b"]" * 100_000 + b"}",
            None,
            f"nested deeper than {MAX_JSON_DEPTH} levels",
        ),
        (PREFIX + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}", None, "nested deeper than"),
        (PREFIX + b"[" * 200 + b"]" * 200 + b"}", "prompt", f"prompt is nested deeper than {MAX_JSON_DEPTH}"),
        (PREFIX + b'"\\ud800x"}', "prompt", "prompt is not valid Unicode: it holds a lone surrogate"),
        (PREFIX + b'"ok", "stop": ["\\udfff"]}', "stop[0]", "stop[0] is not valid Unicode"),
        (PREFIX + b'"ok", "\\ud800": 1}', None, "a key in the request body is not valid Unicode"),
        (
            PREFIX + b'"\xed\xa0\x80"}',
            None,
            "must be UTF-8, and byte 46 is not",
        ),  # a surrogate, UTF-8-encoded
        (PREFIX + b'"ok", "temperature": NaN}', None, "NaN is not a JSON value"),
        (PREFIX + b'"ok", "temperature": -Infinity}', None, "-Infinity is not a JSON value"),
        (PREFIX + b'"ok", "n": ' + b"1" * 5000 + b"}", None, "a number too long to read"),
        (PREFIX + b'"ok", "temperature": 1' + b"0" * 400 + b"}", "temperature", "must be a finite number"),
    ],
)
def test_bodies_python_reads_but_cannot_serve_are_400(raw, param, message):
    err = error_of(parse_completion_request, raw)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert message in err.message
    json.dumps(err.body(), ensure_ascii=False).encode()  # the reply itself is valid UTF-8


def test_chat_content_with_a_lone_surrogate_is_400_naming_it():
    parts = [{"type": "text", "text": "fine"}, {"type": "text", "text": "\ud800"}]
    err = error_of(parse_chat_request, chat(messages=[{"role": "user", "content": parts}]))
    assert (err.status, err.param) == (400, "messages[0].content[1].text")
    deep_but_fine = {"a": [[[{"b": "\u00e9\U0001f600"}]]]}  # a proper surrogate pair in JSON: one emoji
    assert parse_chat_request(chat(metadata=deep_but_fine), MODELS).messages[0].content == "hi"


def test_messages_quoting_huge_values_are_cut():
    err = error_of(parse_chat_request, chat(model="x" * 100_000))
    assert err.status == 404 and len(err.message) <= MAX_MESSAGE_CHARS and "characters)" in err.message


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "Application/JSON; charset=utf-8", " application/json ;x=y"]
)
def test_json_content_types_are_accepted(content_type):
    check_content_type(content_type)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/json-seq", "", "json"]
)
def test_other_content_types_are_415(content_type):
    with pytest.raises(APIError) as info:
        check_content_type(content_type)
    err = info.value
    assert (err.status, err.code) == (415, "unsupported_media_type") and "Content-Type" in err.message


def test_body_too_large_is_413():
    raw = chat(pad="x" * MAX_BODY_BYTES)
    err = error_of(parse_chat_request, raw)
    assert err.status == 413 and str(MAX_BODY_BYTES) in err.message


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"model": 7}, "model", "model must be a string"),
        ({"stream": "yes"}, "stream", "stream must be a boolean"),
        ({"stream": 1}, "stream", "stream must be a boolean"),
        ({"stream_options": True, "stream": True}, "stream_options", "must be an object"),
        (
            {"stream_options": {"include_usage": "y"}, "stream": True},
            "stream_options.include_usage",
            "boolean",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
        ({"max_tokens": "16"}, "max_tokens", "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens", "max_tokens must be an integer"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be at least 1"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens", "must be an integer"),
        ({"temperature": "hot"}, "temperature", "temperature must be a finite number"),
        ({"temperature": -0.5}, "temperature", "temperature must be in [0, 2]"),
        ({"temperature": 1e30}, "temperature", "temperature must be in [0, 2]"),
        ({"repetition_penalty": 1e30}, "repetition_penalty", "repetition_penalty must be in (0, 2]"),
        ({"user": ["me"]}, "user", "user must be a string"),
        ({"user": 7}, "user", "user must be a string"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k", "top_k must be"),
        ({"min_p": 2}, "min_p", "min_p must be in [0, 1]"),
        ({"seed": 1.5}, "seed", "seed must be an integer"),
        ({"stop": ""}, "stop", "stop must be a non-empty string"),
        ({"stop": ["ok", 3]}, "stop", "stop must be a non-empty string"),
        ({"stop": 5}, "stop", "stop must be a list"),
        ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 2]"),
        ({"ignore_eos": "no"}, "ignore_eos", "ignore_eos must be a boolean"),
        ({"logprobs": 3}, "logprobs", "logprobs must be a boolean"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20]"),
        ({"logprobs": True, "top_logprobs": "5"}, "top_logprobs", "top_logprobs must be an integer"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs"),
        ({"echo": True}, "echo", "echo is served on /v1/completions only"),
        ({"prompt_logprobs": 50}, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
        ({"n": 33}, "n", "n must be in [1, 32], got 33"),
        ({"n": "2"}, "n", "n must be an integer"),
        (
            {"n": 2, "prompt_logprobs": 1},
            "prompt_logprobs",
            "prompt_logprobs is served with n = 1, got n = 2",
        ),
        ({"logit_bias": {"a": 1}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 200}}, "logit_bias", "logit_bias[5] must be in [-100, 100]"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "got 'xml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name and schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "non-empty string",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
            "response_format.json_schema.schema",
            "JSON schema object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}},
            "response_format.json_schema.strict",
            "boolean",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "got regex, choice"),
        ({"structured_outputs": {"json_schema": {}}}, "structured_outputs", "unknown field 'json_schema'"),
        ({"structured_outputs": "a+"}, "structured_outputs", "must be an object"),
        ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
        ({"guided_regex": 5}, "guided_regex", "guided_regex must be a non-empty string"),
        ({"guided_json": "{"}, "guided_json", "guided_json is not valid JSON"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "response_format",
            "got response_format, guided_regex",
        ),
        ({"response_format": "json"}, "response_format", "response_format must be an object"),
        (  # a keyword the grammar library would not hold: named where the request wrote it
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"properties": {"t": {"uniqueItems": True}}}},
                }
            },
            "response_format.json_schema.schema",
            "response_format.json_schema.schema uses uniqueItems at /properties/t (distinct array items), which",
        ),
        (
            {"structured_outputs": {"json": {"not": {"type": "null"}}}},
            "structured_outputs.json",
            "structured_outputs.json uses not at / (",
        ),
        (
            {"guided_json": {"properties": {"x": {"type": "number", "multipleOf": 0.1}}}},
            "guided_json",
            "guided_json uses multipleOf at /properties/x",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "--tool-call-parser"),
        ({"functions": [{"name": "f"}]}, "functions", "send tools and tool_choice instead"),
        ({"n": 0}, "n", "n must be in [1, 32], got 0"),
        ({"messages": "hi"}, "messages", "messages must be a list"),
        ({"messages": []}, "messages", "messages must not be empty"),
        ({"messages": ["hi"]}, "messages[0]", "messages[0] must be an object"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "must be one of system, user",
        ),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "must be one of"),
        ({"priority": "high"}, "priority", "must be an integer"),
        ({"priority": 2**40}, "priority", "within"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "content is required"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a list of text"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
            "only text is supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
            "must be a string",
        ),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(fields, param, message):
    err = error_of(parse_chat_request, chat(**fields))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert message in err.message


SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            {"json": json.dumps(SCHEMA, separators=(",", ":"))},  # properties keep their order
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, {"json_object": True}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"guided_json": SCHEMA}, {"json": json.dumps(SCHEMA, separators=(",", ":"))}),
        ({"guided_regex": "a|b"}, {"regex": "a|b"}),
        ({"guided_choice": ["x"]}, {"choice": ["x"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ],
)
def test_structured_output_fields_become_one_constraint(fields, expected):
    for parse, body in (
        (parse_chat_request, chat(**fields)),
        (parse_completion_request, completion(**fields)),
    ):
        constraint = parse(body, MODELS).sampling.structured_outputs
        assert (constraint.to_wire() if constraint else None) == expected


def test_missing_messages_is_400():
    err = error_of(parse_chat_request, json.dumps({"model": MODELS[0]}).encode())
    assert (err.status, err.param) == (400, "messages")


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "non-empty string or a non-empty list of token ids"),
        ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({"prompt": [True, False]}, "prompt", "list of token ids"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
        ({"prompt": [[1], [2]]}, "prompt", "batched prompts are not supported"),
        ({"logprobs": True}, "logprobs", "logprobs must be an integer"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
        ({"echo": 1}, "echo", "echo must be a boolean"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
        (
            {"echo": True, "prompt_logprobs": -1, "logprobs": 2},
            "prompt_logprobs",
            "prompt_logprobs must be in",
        ),
        ({"max_tokens": 0, "logprobs": 2}, "max_tokens", "max_tokens must be at least 1"),
        ({"suffix": "end"}, "suffix", "suffix is not supported"),
        ({"seed": 2**70}, "seed", "seed must fit in a signed 64-bit integer"),
        ({"logit_bias": {str(10**25): 1}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"best_of": 3}, "best_of", "best_of"),
        ({"n": 64}, "n", "n must be in [1, 32], got 64"),
        ({"echo": True, "logprobs": 1, "n": 2}, "echo", "served with n = 1, got n = 2"),
        ({"echo": True, "max_tokens": 0, "n": 3}, "echo", "served with n = 1, got n = 3"),
        ({"max_tokens": -1}, "max_tokens", "max_tokens must be at least 1"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(fields, param, message):
    err = error_of(parse_completion_request, completion(**fields))
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert message in err.message


def test_unknown_model_is_404_model_not_found():
    for parse, raw in (
        (parse_chat_request, chat(model="gpt-9")),
        (parse_completion_request, completion(model="x")),
    ):
        err = error_of(parse, raw)
        assert (err.status, err.code, err.param) == (404, "model_not_found", "model")


def test_chat_request_fields():
    request = parse_chat_request(
        chat(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=5,
            max_completion_tokens=9,
            temperature=0,
            top_p=0.5,
            stop="\n",
            seed=3,
            logprobs=True,
            top_logprobs=2,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            top_k=4,
            min_p=0.1,
            ignore_eos=True,
            repetition_penalty=1.1,
            logit_bias={"50": -100, "7": 3},
            response_format={"type": "text"},
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="none",  # tools the model must not call: left out of the prompt
            user="someone",  # unknown fields are ignored, as vLLM does
        ),
        MODELS,
    )
    assert request.endpoint == "chat" and request.model == MODELS[0]
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")]
    assert request.stream and request.include_usage
    assert request.max_tokens == 9  # max_completion_tokens wins
    s = request.sampling
    assert (s.temperature, s.top_p, s.stop, s.seed, s.logprobs) == (0.0, 0.5, ["\n"], 3, 2)
    assert (s.presence_penalty, s.frequency_penalty, s.top_k, s.min_p) == (0.5, -0.5, 4, 0.1)
    assert s.ignore_eos and s.repetition_penalty == 1.1
    assert s.logit_bias == {50: -100.0, 7: 3.0}


def test_chat_defaults_and_nulls():
    request = parse_chat_request(chat(temperature=None, stop=None, logprobs=False, n=1), MODELS)
    assert not request.stream and not request.include_usage and request.max_tokens is None
    assert (
        request.sampling.temperature == 1.0
        and request.sampling.stop == []
        and request.sampling.logprobs is None
    )


def test_model_may_be_omitted():
    request = parse_chat_request(json.dumps({"messages": MESSAGES}).encode(), MODELS)
    assert request.model == MODELS[0]


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = parse_chat_request(chat(messages=[{"role": "user", "content": parts}]), MODELS)
    assert request.messages[0].content == "ab"


def test_completion_request_fields():
    request = parse_completion_request(completion(prompt=[[5, 6, 7]], logprobs=3, stop=["a", "b"]), MODELS)
    assert request.endpoint == "completion" and request.prompt == [5, 6, 7] and request.messages is None
    assert request.sampling.logprobs == 3 and request.sampling.stop == ["a", "b"]
    assert parse_completion_request(completion(prompt=["text"]), MODELS).prompt == "text"


def test_n_is_served_on_both_endpoints():
    assert parse_completion_request(completion(n=8), MODELS).sampling.n == 8
    assert parse_chat_request(chat(n=32), MODELS).sampling.n == 32
    assert parse_chat_request(chat(), MODELS).sampling.n == 1


def test_fit_to_context_defaults():
    chat_request = parse_chat_request(chat(), MODELS)
    assert fit_to_context(chat_request, 100, 2048).max_tokens == 1948  # chat: the rest of the context
    text_request = parse_completion_request(completion(), MODELS)
    assert fit_to_context(text_request, 100, 2048).max_tokens == 16  # completions: OpenAI's 16
    assert fit_to_context(text_request, 2040, 2048).max_tokens == 8  # ... shrunk to fit
    assert fit_to_context(parse_chat_request(chat(max_tokens=48), MODELS), 2000, 2048).max_tokens == 48


@pytest.mark.parametrize(
    "request_raw, parse, num_prompt, param",
    [
        (chat(max_tokens=49), parse_chat_request, 2000, "messages"),
        (chat(max_completion_tokens=4000), parse_chat_request, 10, "messages"),
        (chat(), parse_chat_request, 2048, "messages"),
        (completion(max_tokens=100), parse_completion_request, 2000, "prompt"),
        (completion(), parse_completion_request, 3000, "prompt"),
    ],
)
def test_context_overflow_is_400_context_length_exceeded(request_raw, parse, num_prompt, param):
    request = parse(request_raw, MODELS)
    with pytest.raises(APIError) as info:
        fit_to_context(request, num_prompt, 2048)
    err = info.value
    assert (err.status, err.type, err.code, err.param) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
        param,
    )
    assert "maximum context length is 2048 tokens" in err.message


def test_echo_and_prompt_logprobs_decide_what_the_executor_scores():
    def scored(**fields):
        return parse_completion_request(completion(**fields), MODELS).sampling

    assert scored().prompt_logprobs is None
    assert scored(echo=True).prompt_logprobs is None  # the prompt's text needs no scoring
    assert scored(echo=True, logprobs=3).prompt_logprobs == 3
    assert scored(logprobs=3).prompt_logprobs is None  # without echo, logprobs is about the output
    assert scored(echo=True, logprobs=1, prompt_logprobs=4).prompt_logprobs == 4
    zero = scored(echo=True, max_tokens=0)
    assert (zero.max_tokens, zero.prompt_logprobs) == (0, 0)
    request = parse_completion_request(completion(prompt_logprobs=2), MODELS)
    assert (request.echo, request.prompt_logprobs, request.sampling.prompt_logprobs) == (False, 2, 2)
    chat_request = parse_chat_request(chat(prompt_logprobs=0, max_tokens=0), MODELS)
    assert (chat_request.sampling.max_tokens, chat_request.prompt_logprobs) == (0, 0)


def test_priority_is_read_on_both_endpoints_and_defaults_to_zero():
    assert parse_chat_request(chat(priority=-5), MODELS).priority == -5
    assert parse_completion_request(completion(priority=7), MODELS).priority == 7
    assert parse_chat_request(chat(), MODELS).priority == 0
