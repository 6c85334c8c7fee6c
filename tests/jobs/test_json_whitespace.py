"""A job's JSON is compiled without free whitespace unless the request asks to keep it
(``disable_any_whitespace: false``); the offline ``LLM`` keeps the engine's (vLLM's) default."""

import json

import pytest

from weir.engine import LLM, SamplingParams, StructuredOutputsParams
from weir.jobs.schemas import GenerateRequest, parse_request

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour", "size"],
          "properties": {"colour": {"type": "string", "maxLength": 6}, "size": {"enum": ["S", "M", "L"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks_override=64, max_model_len=256)


def test_a_jobs_json_is_compact_unless_it_says_otherwise():
    plain = GenerateRequest(prompt="x", structured_outputs={"json": SCHEMA})
    assert plain.structured_outputs == {"json": SCHEMA, "disable_any_whitespace": True}
    kept = GenerateRequest(prompt="x", structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert kept.structured_outputs == {"json": SCHEMA, "disable_any_whitespace": False}
    stored = kept.model_dump(mode="json", exclude_none=True)
    assert parse_request(stored).sampling_params().structured_outputs.disable_any_whitespace is False
    assert GenerateRequest(prompt="x", structured_outputs={"regex": "a+"}).structured_outputs == {"regex": "a+"}


def test_response_format_is_compact_and_takes_the_whitespace_option():
    assert GenerateRequest(prompt="x", response_format=FORMAT).sampling_params().structured_outputs.key == (
        "json", json.dumps(SCHEMA, sort_keys=True, separators=(",", ":")), True)
    assert GenerateRequest(prompt="x", response_format={"type": "json_object"}).sampling_params(
    ).structured_outputs.disable_any_whitespace is True
    kept = GenerateRequest(prompt="x", response_format=FORMAT, structured_outputs={"disable_any_whitespace": False})
    assert kept.sampling_params().structured_outputs.disable_any_whitespace is False
    assert parse_request(kept.model_dump(mode="json", exclude_none=True)).sampling_params(
    ).structured_outputs.disable_any_whitespace is False


def test_the_offline_llm_keeps_vllms_default():
    assert StructuredOutputsParams(json=SCHEMA).disable_any_whitespace is False
    assert SamplingParams(structured_outputs={"json": SCHEMA}).structured_outputs.disable_any_whitespace is False


def test_the_grammar_admits_whitespace_only_when_asked(llm):
    manager = llm.llm_engine.structured_outputs
    compact = GenerateRequest(prompt="x", structured_outputs={"json": SCHEMA}).sampling_params()
    free = GenerateRequest(prompt="x", structured_outputs={"json": SCHEMA, "disable_any_whitespace": False}
                           ).sampling_params()
    spaced = '{\n  "colour": "red",\n  "size": "S"\n}'
    assert manager.new_request(compact.structured_outputs).matcher.accept_string(spaced) is False
    assert manager.new_request(free.structured_outputs).matcher.accept_string(spaced) is True
    assert manager.new_request(compact.structured_outputs).matcher.accept_string('{"colour": "red", "size": "S"}')


def test_a_tiny_models_job_output_has_no_whitespace_between_fields(llm):
    params = GenerateRequest(prompt="x", structured_outputs={"json": SCHEMA}, max_tokens=60).sampling_params()
    tok = llm.get_tokenizer()
    [out] = llm.generate([tok.encode("Describe an item as JSON.")], params)
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert "\n" not in text
    assert text == json.dumps(json.loads(text), ensure_ascii=False)  # xgrammar's ", " and ": " only
