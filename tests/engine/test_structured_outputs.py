"""Structured outputs: every finished output is valid; masked greedy decoding equals an unbatched
reference (transformers + one xgrammar matcher, token by token); the grammar state survives
chunked prefill, preemption by recompute and n > 1 forks; cut outputs are reported as "length"."""

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from weir.engine import LLM, SamplingParams, StructuredOutputsParams
from weir.engine.structured_outputs import check, choice_grammar

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["item", "size"],
               "properties": {"item": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                       "properties": {"ok": {"type": "boolean"}}},
                              "size": {"enum": ["S", "M", "L"]}}},
    "enum": {"enum": ["red", "green", "blue", 3, None]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 1, "maxItems": 3},
    "bounded_numbers": {"type": "object", "additionalProperties": False, "required": ["n", "x"],
                        "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                                       "x": {"type": "number", "minimum": 0, "maximum": 1}}},
    "string_pattern": {"type": "object", "additionalProperties": False, "required": ["code"],
                       "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}},
}
REGEX = r"(yes|no)-[0-9]{1,3}"
CHOICES = ["alpha", "beta gamma", 'quote " and \\ slash']


def constraint(kind: str, name: str | None = None) -> StructuredOutputsParams:
    if kind == "json":
        return StructuredOutputsParams(json=SCHEMAS[name], disable_any_whitespace=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=REGEX)
    if kind == "choice":
        return StructuredOutputsParams(choice=CHOICES)
    if kind == "grammar":
        return StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")"')
    return StructuredOutputsParams(json_object=True)


GRID = [("json", n) for n in SCHEMAS] + [("regex", None), ("choice", None), ("grammar", None),
                                         ("json_object", None)]


def valid(spec: StructuredOutputsParams, text: str) -> bool:
    if spec.kind == "json":
        try:
            jsonschema.validate(json.loads(text), spec.json)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.regex, text) is not None
    if spec.kind == "choice":
        return text in spec.choice
    if spec.kind == "grammar":
        return re.fullmatch(r"\([a-c]+\)", text) is not None
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def prompt_ids(tokenizer, i: int) -> list[int]:
    return tokenizer.encode(f"Request number {i}: answer in the required format.")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks_override=128, max_model_len=256)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def reference_greedy(hf_model, tokenizer, eos_id: int, prompt: list[int], spec, max_tokens: int) -> list[int]:
    """One sequence, no batch and no cache: transformers' logits, masked by one matcher."""
    vocab = hf_model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos_id])
    grammar = StructuredOutputsParams.from_dict(spec.to_dict())
    from weir.engine.structured_outputs import _grammar

    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(_grammar(grammar)))
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()[None]
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
    return out


def grid_requests(tokenizer, repeat: int = 1):
    return [(prompt_ids(tokenizer, i), constraint(*GRID[i % len(GRID)])) for i in range(len(GRID) * repeat)]


def test_every_finished_output_is_valid_on_a_grid_of_constraints(llm):
    tok = llm.get_tokenizer()
    reqs = grid_requests(tok, repeat=3)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=s)
              for i, (_, s) in enumerate(reqs)]
    outs = llm.generate([p for p, _ in reqs], params)
    reasons = [o.outputs[0].finish_reason for o in outs]
    for (_, spec), o in zip(reqs, outs):
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert valid(spec, c.text), (spec.kind, c.text)
    # every kind has at least one complete output (random weights: long strings may run to length)
    done_kinds = {GRID[i % len(GRID)] for i, r in enumerate(reasons) if r == "stop"}
    assert done_kinds == set(GRID), set(GRID) - done_kinds
    assert set(reasons) <= {"stop", "length"}


def test_masked_greedy_equals_the_unbatched_reference(llm, hf_model):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    reqs = grid_requests(tok)
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=s) for _, s in reqs]
    got = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in reqs], params)]
    want = [reference_greedy(hf_model, tok, eos, p, s, 24) for p, s in reqs]
    assert got == want


def test_grammar_state_survives_chunked_prefill_and_preemption(tiny_model_dir):
    """An 8-token budget splits every prompt (11 tokens) into chunks; 6 blocks for 8 sequences
    preempt some."""
    plain = LLM(tiny_model_dir, num_gpu_blocks_override=256, max_model_len=256)
    tight = LLM(tiny_model_dir, num_gpu_blocks_override=6, max_model_len=96, max_num_batched_tokens=8,
                max_num_seqs=8)
    tok = plain.get_tokenizer()
    reqs = grid_requests(tok)[:8]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=40, structured_outputs=s)
              for i, (_, s) in enumerate(reqs)]
    want = plain.generate([p for p, _ in reqs], params)
    got = tight.generate([p for p, _ in reqs], params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for (_, spec), o in zip(reqs, got):
        if o.outputs[0].finish_reason == "stop":
            assert valid(spec, o.outputs[0].text)


def test_n_samples_each_follow_the_grammar_and_equal_single_requests(llm):
    """Each of n sequences has its own matcher; sample i equals a request with sample i's seed."""
    tok = llm.get_tokenizer()
    spec = constraint("json", "bounded_numbers")
    prompt = prompt_ids(tok, 0)
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=32,
                                                structured_outputs=spec))[0]
    assert len(out.outputs) == 4
    for i, c in enumerate(out.outputs):
        if c.finish_reason == "stop":
            assert valid(spec, c.text), c.text
        single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=SamplingParams(seed=7).sample_seed(i),
                                                       max_tokens=32, structured_outputs=spec))[0]
        assert single.outputs[0].token_ids == c.token_ids
    assert sum(c.finish_reason == "stop" for c in out.outputs) >= 1


def test_cut_output_is_length_and_a_stop_string_ends_a_constrained_request(llm):
    tok = llm.get_tokenizer()
    spec = constraint("json", "nested")
    cut = llm.generate([prompt_ids(tok, 1)], SamplingParams(temperature=0, max_tokens=3, structured_outputs=spec))
    c = cut[0].outputs[0]
    assert (c.finish_reason, len(c.token_ids)) == ("length", 3)
    assert not valid(spec, c.text)
    full = llm.generate([prompt_ids(tok, 1)], SamplingParams(temperature=0, max_tokens=40,
                                                             structured_outputs=spec))[0].outputs[0]
    assert full.finish_reason == "stop" and valid(spec, full.text)
    stopped = llm.generate([prompt_ids(tok, 1)], SamplingParams(temperature=0, max_tokens=40, stop=['"size"'],
                                                                structured_outputs=spec))[0].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", '"size"')
    assert stopped.text == full.text[:full.text.index('"size"')]


def test_compiled_once_per_spec(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_gpu_blocks_override=64, max_model_len=128)
    tok = llm.get_tokenizer()
    spec_text = json.dumps(SCHEMAS["enum"])
    params = [SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(json=spec_text if i % 2 else SCHEMAS["enum"],
                                                                        disable_any_whitespace=True))
              for i in range(10)]
    llm.generate([prompt_ids(tok, i) for i in range(10)], params)
    stats = llm.llm_engine.stats()
    # one compile; every later lookup finds it (a schema and its text share a key): per request,
    # generate's check of the whole batch, add_request's check and the sequence's matcher
    assert stats["num_grammars_compiled"] == 1
    assert stats["grammar_cache_hits"] == 3 * 10 - 1


@pytest.mark.parametrize("spec, field", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, "structured_outputs.json"),
    ({"regex": "(ab"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
])
def test_a_constraint_the_backend_cannot_compile_is_refused_before_anything_runs(llm, spec, field):
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    with pytest.raises(ValueError, match=re.escape(field)):
        check(params)
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=4), params])
    assert not llm.llm_engine.has_unfinished()


@pytest.mark.parametrize("bad, message", [
    ({}, "exactly one of"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"jsn": {}}, "unknown field(s) jsn"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_params_are_checked_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=bad)


def test_choice_grammar_quotes_every_string():
    assert choice_grammar(["a", 'b"c']) == 'root ::= "a" | "b\\"c"'


def test_without_a_tokenizer_constraints_are_refused(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_gpu_blocks_override=32, max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(structured_outputs={"regex": "a+"}))


def test_json_object_admits_objects_only(llm):
    """OpenAI's json_object is an object, not any JSON value: the first token opens one."""
    manager = llm.llm_engine.structured_outputs
    state = manager.new_request(StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    bitmask = manager.grammar_bitmask([state])
    logits = torch.zeros(1, manager.vocab_size)
    from weir.engine.structured_outputs import apply_grammar_bitmask

    apply_grammar_bitmask(logits, bitmask)
    allowed = [llm.get_tokenizer().decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()]
    assert allowed and all(a.startswith("{") for a in allowed), allowed[:20]


def test_the_grammar_cache_drops_the_least_recently_used(llm):
    from weir.engine.structured_outputs import StructuredOutputManager

    eng = llm.llm_engine
    manager = StructuredOutputManager(eng.tokenizer, eng.config.vocab_size, eng.eos_token_ids, max_cached_grammars=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    manager.compile(a)
    manager.compile(b)
    manager.compile(a)  # a is now the most recent
    manager.compile(c)  # drops b
    manager.compile(a)
    manager.compile(b)  # compiled again
    assert (manager.num_compiled, manager.num_cache_hits) == (4, 2)


def test_the_front_compiles_in_the_callers_thread_and_refuses_there(llm):
    from weir.engine import EngineFront

    front = EngineFront(llm)
    try:
        with pytest.raises(ValueError, match=re.escape("structured_outputs.regex")):
            front.submit_generate([5, 6, 7], SamplingParams(structured_outputs={"regex": "(a"}))
        before = llm.llm_engine.structured_outputs.num_compiled
        spec = StructuredOutputsParams(regex=r"[0-9]{2}-only-front")
        fut = front.submit_generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=16, structured_outputs=spec))
        # compiled by the time submit_generate returns (in the caller, before queueing)
        assert llm.llm_engine.structured_outputs.num_compiled == before + 1
        out = fut.result(timeout=120).outputs[0]
        assert out.finish_reason == "length" or re.fullmatch(spec.regex, out.text)
    finally:
        front.shutdown()


@pytest.mark.parametrize("schema, found", [
    ({"not": {}}, "'not' at #"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'allOf' at #"),
    ({"$ref": "http://example.com/s.json"}, "'$ref' to 'http://example.com/s.json' at #"),
    ({"type": "object", "patternProperties": {"a": {}}}, "'patternProperties' at #"),
    ({"$defs": {"x": {"type": "integer", "multipleOf": 3}}, "$ref": "#/$defs/x"}, "'multipleOf' at #/$defs/x"),
    ({"type": "array", "items": {"type": "object", "properties": {"a": {"if": {}}}}}, "'if' at #/items/properties/a"),
    ({"anyOf": [{"type": "string"}, {"type": "array", "uniqueItems": True}]}, "'uniqueItems' at #/anyOf/1"),
])
def test_a_keyword_the_grammar_would_ignore_is_refused_naming_where(schema, found):
    """xgrammar ignores these (with a log line at most), so outputs could break the schema."""
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.json is not supported: {found}")):
        check(SamplingParams(structured_outputs={"json": schema}))


@pytest.mark.parametrize("regex, found", [
    ("a^b", "'^' at position 1"), ("a$b", "'$' at position 1"), ("(^a|b)", "'^' at position 1"),
    ("[^]a]^", "'^' at position 5"), (None, None),
])
def test_an_inner_anchor_the_grammar_would_drop_is_refused(regex, found):
    """xgrammar drops an anchor inside the pattern (``a^b`` would admit ``ab``)."""
    if regex is None:  # anchors at the ends, escaped or in a class pass
        for ok in ("^ab$", "a\\^b\\$", "[^a]b", "[a^$]"):
            check(SamplingParams(structured_outputs={"regex": ok}))
        return
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.regex is not supported: anchor {found}")):
        check(SamplingParams(structured_outputs={"regex": regex}))


def test_annotations_and_local_refs_pass():
    check(SamplingParams(structured_outputs={"json": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "t", "type": "object",
        "$defs": {"n": {"type": "integer", "description": "d", "minimum": 0}},
        "properties": {"email": {"type": "string", "format": "email"}, "n": {"$ref": "#/$defs/n"},
                       "v": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
        "required": ["email"], "additionalProperties": False}}))


def test_a_grammar_that_admits_no_output_is_refused(llm):
    params = SamplingParams(structured_outputs={"regex": r"[^\s\S]"})
    with pytest.raises(ValueError, match=re.escape("structured_outputs.regex admits no output")):
        llm.generate([[5, 6, 7]], params)
    assert not llm.llm_engine.has_unfinished()


def test_the_check_builds_a_constraint_once_and_refuses_a_bad_one_every_time(monkeypatch):
    from weir.engine import structured_outputs as so

    built = []
    grammar = so._grammar
    monkeypatch.setattr(so, "_grammar", lambda spec: built.append(spec.key) or grammar(spec))
    monkeypatch.setattr(so, "_checked_keys", type(so._checked_keys)())
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    for _ in range(3):
        so.check(schema)
        so.check(SamplingParams(structured_outputs=schema))
    bad = StructuredOutputsParams(regex="(")
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs.regex is not supported"):
            so.check(bad)
    assert built == [schema.key, bad.key, bad.key]
