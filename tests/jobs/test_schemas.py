import pytest
from pydantic import ValidationError

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
        ({"kind": "generate", "prompt": 5}, [(("prompt", "messages"), "list_type")]),
        ({"kind": "generate", "prompt": "x", "temperature": -0.1},
         [(("temperature",), "greater_than_equal")]),
        ({"kind": "generate", "prompt": "x", "top_p": 0}, [(("top_p",), "greater_than")]),
        ({"kind": "generate", "prompt": "x", "top_p": 1.5}, [(("top_p",), "less_than_equal")]),
        ({"kind": "generate", "prompt": "x", "top_k": -2}, [(("top_k",), "greater_than_equal")]),
        ({"kind": "generate", "prompt": "x", "max_tokens": 0},
         [(("max_tokens",), "greater_than_equal")]),
        ({"kind": "generate", "prompt": "x", "seed": -1}, [(("seed",), "greater_than_equal")]),
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


def test_sampling_fields_have_vllm_names_and_defaults():
    request = GenerateRequest(prompt="x", temperature=0.5, seed=7)
    assert request.sampling_fields() == {
        "temperature": 0.5, "top_p": 1.0, "top_k": 0, "seed": 7, "max_tokens": 16,
    }


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
    request = ClassifyRequest(prompt="x", labels=["a", "b"], custom_id="p1", metadata={"product_id": 7})
    stored = request.model_dump(mode="json", exclude_none=True)
    assert parse_request(stored) == request
    assert parse_request(stored).product_id == "7"


@pytest.mark.parametrize("fields, loc", [
    ({"temperature": float("inf")}, ("temperature",)),
    ({"temperature": float("nan")}, ("temperature",)),
    ({"seed": 2**70}, ("seed",)),
    ({"max_tokens": True}, ("max_tokens",)),
    ({"temperature": "0.5"}, ("temperature",)),
    ({"top_k": 2.0}, ("top_k",)),
    ({"metadata": {"product_id": "p" * 65}}, ("metadata",)),
    ({"metadata": {"product_id": {"nested": 1}}}, ("metadata",)),
])
def test_out_of_range_values_are_refused_naming_the_field(fields, loc):
    from pydantic import ValidationError

    from weir.jobs.schemas import GenerateRequest

    with pytest.raises(ValidationError) as err:
        GenerateRequest(prompt="x", **fields)
    assert err.value.errors()[0]["loc"] == loc
