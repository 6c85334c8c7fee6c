import pytest
from pydantic import ValidationError

from weir.jobs.catalog.marker import enrichment_of
from weir.jobs.schemas import ChatMessage, ClassifyRequest, GenerateRequest, parse_request


def error_fields(exc: ValidationError) -> list[tuple]:
    return [(e["loc"], e["type"]) for e in exc.errors()]


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"kind": "summarize", "prompt": "x"}, [(("kind",), "literal_error")]),
        ({"prompt": "x"}, [(("kind",), "missing")]),
        ({"kind": "generate", "prompt": ""}, [(("prompt",), "value_error")]),
        ({"kind": "generate", "prompt": "  \n"}, [(("prompt",), "value_error")]),
        ({"kind": "generate", "prompt": []}, [(("prompt",), "value_error")]),
        ({"kind": "generate", "prompt": [{"role": "user", "content": ""}]},
         [(("prompt", "messages", 0, "content"), "string_too_short")]),
        ({"kind": "generate", "prompt": [{"role": "robot", "content": "x"}]},
         [(("prompt", "messages", 0, "role"), "literal_error")]),
        ({"kind": "generate", "prompt": 5}, [(("prompt",), "value_error")]),
        ({"kind": "generate", "prompt": "x", "temperature": -0.1},
         [(("temperature",), "sampling_params")]),
        ({"kind": "generate", "prompt": "x", "top_p": 0}, [(("top_p",), "sampling_params")]),
        ({"kind": "generate", "prompt": "x", "top_p": 1.5}, [(("top_p",), "sampling_params")]),
        ({"kind": "generate", "prompt": "x", "top_k": -2}, [(("top_k",), "sampling_params")]),
        ({"kind": "generate", "prompt": "x", "max_tokens": 0},
         [(("max_tokens",), "sampling_params")]),
        ({"kind": "generate", "prompt": "x", "seed": -1}, [(("seed",), "sampling_params")]),
        ({"kind": "generate", "prompt": "x", "max_token": 5}, [(("max_token",), "extra_forbidden")]),
        ({"kind": "classify", "prompt": "x", "labels": []}, [(("labels",), "too_short")]),
        ({"kind": "classify", "prompt": "x"}, [(("labels",), "missing")]),
        ({"kind": "classify", "prompt": "x", "labels": ["a", "b", "a"]}, [(("labels",), "value_error")]),
        ({"kind": "classify", "prompt": "x", "labels": ["a", " "]}, [(("labels",), "value_error")]),
        ({"kind": "classify", "prompt": "", "labels": ["a"]}, [(("prompt",), "value_error")]),
        ({"kind": "classify", "prompt": "x", "labels": ["a"], "temperature": 0},
         [(("temperature",), "extra_forbidden")]),
        ({"kind": "generate", "prompt": "x", "custom_id": ""}, [(("custom_id",), "string_too_short")]),
    ],
)
def test_invalid_requests_name_the_field(data, expected):
    with pytest.raises(ValidationError) as info:
        parse_request(data)
    assert error_fields(info.value) == expected


def test_duplicate_labels_message_names_them():
    with pytest.raises(ValidationError, match=r"repeated: \['b'\]"):
        ClassifyRequest(prompt="x", labels=["a", "b", "b"])


def test_valid_requests_parse_to_their_kind():
    generate = parse_request({"kind": "generate", "prompt": "hi", "temperature": 0, "max_tokens": 4})
    classify = parse_request({"kind": "classify", "prompt": "hi", "labels": ["yes", "no"]})
    assert isinstance(generate, GenerateRequest) and generate.max_tokens == 4
    assert isinstance(classify, ClassifyRequest) and classify.labels == ["yes", "no"]
    assert parse_request(generate) is generate


def test_sampling_fields_are_every_engine_field_with_its_defaults():
    import dataclasses

    from weir.engine import SamplingParams

    request = GenerateRequest(prompt="x", temperature=0.5, seed=7)
    expected = {f.name: getattr(SamplingParams(temperature=0.5, seed=7), f.name)
                for f in dataclasses.fields(SamplingParams)}
    assert request.sampling_fields() == expected
    assert request.sampling_fields() == {
        "n": 1, "temperature": 0.5, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 7, "max_tokens": 16,
        "min_tokens": 0, "stop": [], "stop_token_ids": [], "include_stop_str_in_output": False,
        "ignore_eos": False, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "logprobs": None, "prompt_logprobs": None, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "structured_outputs": None,
    }


def test_every_sampling_field_is_carried_and_stored_as_the_engine_normalises_it():
    request = GenerateRequest(prompt="x", n=2, stop="\n", min_tokens=3, presence_penalty=0.5,
                              frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=2, top_k=-1,
                              stop_token_ids=(7,), structured_outputs={"regex": "[a-z]+"})
    stored = request.model_dump(mode="json", exclude_none=True)
    assert {k: stored[k] for k in ("n", "stop", "min_tokens", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "logprobs", "top_k", "stop_token_ids",
                                   "structured_outputs")} == {
        "n": 2, "stop": ["\n"], "min_tokens": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "logprobs": 2, "top_k": 0, "stop_token_ids": [7],
        "structured_outputs": {"regex": "[a-z]+"},
    }
    assert parse_request(stored) == request
    params = parse_request(stored).sampling_params()
    assert (params.n, params.stop, params.logprobs, params.structured_outputs.regex) == (2, ["\n"], 2, "[a-z]+")


@pytest.mark.parametrize("fields, loc, message", [
    ({"stop": 5}, ("stop",), "stop must be None, a string or a list of strings, got 5"),
    ({"min_tokens": 20, "max_tokens": 10}, ("min_tokens",), "min_tokens must be an integer in [0, max_tokens=10], got 20"),
    ({"presence_penalty": 3}, ("presence_penalty",), "presence_penalty must be in [-2, 2], got 3"),
    ({"n": 0}, ("n",), "n must be an integer >= 1, got 0"),
    ({"logprobs": -1}, ("logprobs",), "logprobs must be None or >= 0, got -1"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, ("structured_outputs",),
     "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"structured_outputs": {"regexp": "a"}}, ("structured_outputs",),
     "structured_outputs has unknown field(s) regexp; known: json, regex, choice, grammar, json_object, "
     "disable_any_whitespace"),
])
def test_sampling_fields_are_refused_with_the_engines_message_at_its_field(fields, loc, message):
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt="x", **fields)
    [error] = info.value.errors()
    assert (error["loc"], error["type"], error["msg"]) == (loc, "sampling_params", message)


def test_an_unknown_sampling_field_is_refused_by_name():
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt="x", stop_strings=["a"])
    assert [(e["loc"], e["type"]) for e in info.value.errors()] == [(("stop_strings",), "extra_forbidden")]


def test_response_format_maps_to_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = GenerateRequest(prompt="x", response_format={
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    stored = request.model_dump(mode="json", exclude_none=True)
    assert stored["response_format"] == {"type": "json_schema",
                                         "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert parse_request(stored).sampling_params().structured_outputs.json == schema
    assert request.wants_json
    json_object = GenerateRequest(prompt="x", response_format={"type": "json_object"})
    assert json_object.sampling_params().structured_outputs.json_object is True and json_object.wants_json
    text = GenerateRequest(prompt="x", response_format={"type": "text"})
    assert text.sampling_params().structured_outputs is None and not text.wants_json
    assert GenerateRequest(prompt="x", structured_outputs={"json": schema}).wants_json
    assert not GenerateRequest(prompt="x", structured_outputs={"regex": "a+"}).wants_json


@pytest.mark.parametrize("fields, loc, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     ("response_format", "json_schema", "schema"),
     'response_format.json_schema.schema is not supported: Unsupported type "nonsense"'),
    ({"structured_outputs": {"regex": "("}}, ("structured_outputs", "regex"),
     "structured_outputs.regex is not supported: Regex parsing error at position 2: The parenthesis is not closed."),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, ("structured_outputs",),
     "structured_outputs: give response_format or structured_outputs, not both"),
])
def test_a_constraint_the_backend_cannot_compile_is_refused_naming_the_field(fields, loc, message):
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt="x", **fields)
    [error] = info.value.errors()
    assert (error["loc"], error["msg"]) == (loc, message)


def test_response_format_shapes_are_checked():
    with pytest.raises(ValidationError, match="json_schema needs json_schema"):
        GenerateRequest(prompt="x", response_format={"type": "json_schema"})
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt="x", response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    assert [e["loc"] for e in info.value.errors()] == [("response_format", "json_schema", "name")]


def test_a_schema_must_be_plain_json():
    import datetime

    with pytest.raises(ValidationError, match=r"response_format.json_schema.schema\['default'\] is a datetime.date"):
        GenerateRequest(prompt="x", response_format={"type": "json_schema", "json_schema": {
            "name": "d", "schema": {"type": "string", "default": datetime.date(2026, 1, 1)}}})


def test_a_prompt_dict_is_refused_naming_its_keys():
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt={"promt": "Hello"})
    [error] = info.value.errors()
    assert error["loc"] == ("prompt",)
    assert "not a dict (keys 'promt')" in error["msg"]


@pytest.mark.parametrize("prompt, named", [(None, "None"), (42, "int"), (b"Hello", "bytes")])
def test_a_prompt_neither_a_string_nor_messages_is_refused_naming_its_type(prompt, named):
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt=prompt)
    [error] = info.value.errors()
    assert error["loc"] == ("prompt",)
    assert error["msg"] == ("Value error, a prompt is a string or a list of chat messages ({'role': ..., "
                            f"'content': ...}}), not {named}")
    assert ClassifyRequest(prompt="x", labels=["a", "b"], calibration_prompt=None).calibration_prompt is None


def test_labels_must_be_a_list_not_a_string():
    with pytest.raises(ValidationError) as info:
        ClassifyRequest(prompt="x", labels="AB")
    assert [(e["loc"], e["type"]) for e in info.value.errors()] == [(("labels",), "list_type")]


def test_engine_prompt_raw_string_stays_raw():
    assert GenerateRequest(prompt="Once upon").engine_prompt() == "Once upon"


def test_engine_prompt_system_prompt_makes_chat():
    request = GenerateRequest(prompt="Product: Tea", system_prompt="Describe it.")
    assert request.engine_prompt() == [
        {"role": "system", "content": "Describe it."},
        {"role": "user", "content": "Product: Tea"},
    ]


def test_engine_prompt_messages_follow_system_prompt():
    request = ClassifyRequest(
        prompt=[ChatMessage(role="user", content="Is tea a drink?")],
        system_prompt="Answer yes or no.",
        labels=["yes", "no"],
    )
    assert request.engine_prompt() == [
        {"role": "system", "content": "Answer yes or no."},
        {"role": "user", "content": "Is tea a drink?"},
    ]


def test_round_trip_through_stored_json():
    request = ClassifyRequest(prompt="x", labels=["a", "b"], custom_id="p1", metadata={"product_id": 7},
                              extensions={"enrichment": {"catalog": "/data/a.csv", "product_id": "7"}})
    stored = request.model_dump(mode="json", exclude_none=True)
    assert parse_request(stored) == request
    assert stored["extensions"] == {"enrichment": {"catalog": "/data/a.csv", "product_id": "7"}}


@pytest.mark.parametrize("fields, loc", [
    ({"temperature": float("inf")}, ("temperature",)),
    ({"temperature": float("nan")}, ("temperature",)),
    ({"seed": 2**70}, ("seed",)),
    ({"max_tokens": True}, ("max_tokens",)),
    ({"temperature": "0.5"}, ("temperature",)),
    ({"top_k": 2.0}, ("top_k",)),
    ({"extensions": {"enrichment": {"catalog": "c", "product_id": "p" * 65}}}, ("extensions", "enrichment", "product_id")),
    ({"extensions": {"enrichment": {"catalog": "c", "product_id": 7}}}, ("extensions", "enrichment", "product_id")),
    ({"metadata": {"when": {1, 2}}}, ("metadata",)),
    ({"extensions": {"enrichment": {"catalog": "c", "product_id": "7", "field": "attributes"}}},
     ("extensions", "enrichment", "field")),
    ({"extensions": {"enrichment": {"catalog": "c", "product_id": "7", "field": "category"}}},
     ("extensions", "enrichment", "field")),
    ({"extensions": {"enrichment": {"catalog": "c", "product_id": "7", "field": "colour"}}},
     ("extensions", "enrichment", "field")),
    ({"extensions": {"nosuch": {}}}, ("extensions", "nosuch")),
])
def test_out_of_range_values_are_refused_naming_the_field(fields, loc):
    from pydantic import ValidationError

    from weir.jobs.schemas import GenerateRequest

    with pytest.raises(ValidationError) as err:
        GenerateRequest(prompt="x", **fields)
    assert err.value.errors()[0]["loc"] == loc


def test_an_enrichment_field_must_be_one_the_job_fills():
    from pydantic import ValidationError

    from weir.jobs.schemas import GenerateRequest

    target = {"catalog": "c", "product_id": "7"}
    with pytest.raises(ValidationError, match="a classification job fills category, not description"):
        ClassifyRequest(prompt="x", labels=["a", "b"], extensions={"enrichment": {**target, "field": "description"}})
    with pytest.raises(ValidationError, match="attributes are filled only by a job constrained to JSON"):
        GenerateRequest(prompt="x", extensions={"enrichment": {**target, "field": "attributes"}},
                        structured_outputs={"regex": "a+"})
    request = GenerateRequest(prompt="x", extensions={"enrichment": {**target, "field": "attributes"}},
                              response_format={"type": "json_object"})
    assert enrichment_of(parse_request(request.model_dump(mode="json", exclude_none=True))).field == "attributes"
