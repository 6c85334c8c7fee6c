"""OpenAI batch files: request lines parsed into weir requests, stored, and read back as output and
error lines and a Batch object that the ``openai`` package's own types accept."""

import json
import uuid
from datetime import timedelta, timezone

import pytest

from tests import support
from weir.jobs import batches, openai_batch
from weir.jobs.client import BatchProgress
from weir.jobs.db import BatchStatus, JobStatus
from weir.jobs.openai_batch import (
    CHAT_COMPLETIONS, CLASSIFICATIONS, COMPLETIONS, BatchFileError, parse_batch_file,
)
from weir.jobs.results import JobResult
from weir.jobs.schemas import ClassifyRequest, GenerateRequest

MODEL = "tiny"


def line(custom_id, body, url=CHAT_COMPLETIONS, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat(text="Hi", **fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


def refusal(lines):
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file(lines, model=MODEL, path="in.jsonl")
    return caught.value.errors


def store_batch(session_factory, lines, window="24h", model=MODEL):
    parsed = parse_batch_file(lines, model=MODEL)
    metadata = openai_batch.batch_metadata(parsed.endpoint, "in.jsonl", window, {"team": "search"})
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, parsed.requests, model=model, metadata=metadata)
    return batch.id, jobs


def finish(session_factory, job, result):
    with session_factory.begin() as session:
        claimed = support.claim_job(session, job.id)
        assert support.record_result(session, claimed, result)


def status_of(session_factory, batch_id):
    with session_factory() as session:
        return BatchProgress.of(batches.get_batch(session, batch_id))


def result_lines(session_factory, batch_id):
    batch = openai_batch.batch_object(status_of(session_factory, batch_id))
    with session_factory() as session:
        jobs = batches.list_jobs(session, batch_id)
    return [openai_batch.result_line(job, batch) for job in jobs]


def entry(token_id, logprob, token, rank=1):
    return {"token_id": token_id, "logprob": logprob, "rank": rank, "decoded_token": token}


def test_chat_body_maps_onto_generate_request():
    parsed = parse_batch_file([
        line("a", chat(max_completion_tokens=5, logprobs=True, top_logprobs=2, stop="\n", seed=7,
                       temperature=0.5, top_p=0.9, n=2, presence_penalty=0.1, frequency_penalty=0.2)),
        line("b", {"messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                             {"type": "text", "text": "there"}]}],
                   "response_format": {"type": "json_object"}}),
    ], model=MODEL)
    a, b = parsed.requests
    assert parsed.endpoint == CHAT_COMPLETIONS
    assert (a.custom_id, a.engine_prompt(), a.max_tokens, a.logprobs, a.stop, a.seed, a.temperature, a.top_p,
            a.n, a.presence_penalty, a.frequency_penalty) == (
        "a", [{"role": "user", "content": "Hi"}], 5, 2, ["\n"], 7, 0.5, 0.9, 2, 0.1, 0.2)
    assert b.engine_prompt() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert b.structured_outputs is None and b.sampling_params().structured_outputs.json_object is True


def test_completion_and_classification_bodies_map_onto_weir_requests():
    [completion] = parse_batch_file([line("c", {"prompt": "Tea is", "max_tokens": 3, "logprobs": 1},
                                          url=COMPLETIONS)], model=MODEL).requests
    assert isinstance(completion, GenerateRequest)
    assert (completion.engine_prompt(), completion.max_tokens, completion.logprobs) == ("Tea is", 3, 1)
    [classify] = parse_batch_file([line("k", {"model": MODEL, "prompt": "Green tea", "labels": ["tea", "coffee"],
                                              "system_prompt": "Classify."}, url=CLASSIFICATIONS)],
                                  model=MODEL).requests
    assert isinstance(classify, ClassifyRequest)
    assert (classify.labels, classify.system_prompt, classify.custom_id) == (["tea", "coffee"], "Classify.", "k")


def test_bad_lines_are_refused_each_by_line_number_and_field():
    errors = refusal([
        "not json",
        line("a", chat(temperature=-1)),
        line("b", chat(user="me")),
        "",
        line("c", chat(model="gpt-4o")),
        line("d", chat(), method="GET"),
        line("a", chat()),
        line("e", {"prompt": "x"}, url=COMPLETIONS),
        line("f", chat(max_tokens=4, max_completion_tokens=4)),
        line("g", chat(top_logprobs=2)),
        line("h", {"messages": [{"role": "user", "content": ""}]}),
    ])
    assert errors == [
        "line 1: not JSON (Expecting value: line 1 column 1 (char 0))",
        "line 2: body.temperature: must be a finite number >= 0, got -1",
        "line 3: body.user: not supported for /v1/chat/completions",
        "line 5: body.model: 'gpt-4o' is not the workers' model 'tiny'",
        "line 6: method: must be \"POST\", not 'GET'",
        "line 7: custom_id: 'a' is already line 2's",
        "line 8: url: /v1/completions differs from line 2's /v1/chat/completions; a batch file has one endpoint",
        "line 9: body.max_completion_tokens: give max_tokens or max_completion_tokens, not both",
        "line 10: body.top_logprobs: needs logprobs: true",
        "line 11: body.messages[0].content: String should have at least 1 character",
    ]


def test_a_refused_file_names_at_most_ten_lines_and_counts_the_rest():
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file([line(str(i), chat(n=0)) for i in range(12)], model=MODEL, path="in.jsonl")
    assert caught.value.num_bad_lines == 12 and len(caught.value.errors) == 10
    assert str(caught.value).splitlines()[-3:] == [
        "in.jsonl: line 10: body.n: must be an integer >= 1, got 0",
        "in.jsonl: ... and 2 more bad lines",
        "in.jsonl: 12 bad lines; nothing was stored",
    ]
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file([line(str(i), chat(n=0)) for i in range(11)], model=MODEL, path="in.jsonl")
    assert str(caught.value).splitlines()[-2:] == [
        "in.jsonl: ... and 1 more bad line", "in.jsonl: 11 bad lines; nothing was stored"]
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file([line("a", chat(n=0)), line("b", chat())], model=MODEL, path="in.jsonl")
    assert str(caught.value).splitlines() == [
        "in.jsonl: line 1: body.n: must be an integer >= 1, got 0", "in.jsonl: 1 bad line; nothing was stored"]


@pytest.mark.parametrize("lines", [[], ["", "  \n", "\n"]])
def test_a_file_with_no_request_says_only_that(lines):
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file(lines, model=MODEL, path="in.jsonl")
    assert str(caught.value) == "in.jsonl: the file holds no request (it is empty or blank); nothing was stored"
    assert (caught.value.errors, caught.value.num_bad_lines) == (
        ["the file holds no request (it is empty or blank); nothing was stored"], 0)


def test_a_too_long_prompt_is_reported_with_the_other_bad_lines(tiny_model_dir):
    from weir.jobs.model_info import PromptChecker

    checker = PromptChecker.for_model(tiny_model_dir, max_logprobs=20)
    long_text = "word " * 600
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file([
            line("ok", chat()),
            line("long", chat(long_text)),
            line("cold", chat(temperature=-1)),
            line("much", chat(max_completion_tokens=600)),
            line("top", chat(logprobs=True, top_logprobs=21)),
            "not json",
            line("stop", chat(stop_token_ids=[1, 49152])),
            line("fits", chat("word " * 460)),
            line("nearly", chat("word " * 460, max_tokens=32)),
        ], model=MODEL, path="in.jsonl", checker=checker)
    assert str(caught.value).splitlines() == [
        "in.jsonl: line 2: body.messages: prompt has 631 tokens; max_model_len=512 leaves no room for output",
        "in.jsonl: line 3: body.temperature: must be a finite number >= 0, got -1",
        "in.jsonl: line 4: body.max_completion_tokens: max_completion_tokens=600 is more than max_model_len=512",
        "in.jsonl: line 5: body.top_logprobs: top_logprobs=21 is more than max_logprobs=20 (WEIR_MAX_LOGPROBS)",
        "in.jsonl: line 6: not JSON (Expecting value: line 1 column 1 (char 0))",
        "in.jsonl: line 7: body.stop_token_ids: stop_token_ids outside the vocabulary [0, 49152): [49152]",
        "in.jsonl: line 9: body.max_tokens: prompt (491 tokens) plus max_tokens=32 is 523 tokens, more than "
        "max_model_len=512",
        "in.jsonl: 7 bad lines; nothing was stored",
    ]
    # the first ten bad lines in line order, whichever check found them
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file([line(f"t{i}", chat(temperature=-1)) for i in range(6)]
                         + [line(f"l{i}", chat(long_text)) for i in range(6)], model=MODEL, checker=checker)
    assert caught.value.num_bad_lines == 12
    assert [e.split(":", 2)[:2] for e in caught.value.errors] == (
        [[f"line {n}", " body.temperature"] for n in range(1, 7)] + [[f"line {n}", " body.messages"] for n in range(7, 11)])


def test_a_max_tokens_the_line_does_not_give_is_said_to_be_the_default(tiny_model_dir):
    from weir.jobs.model_info import PromptChecker

    checker = PromptChecker.for_model(tiny_model_dir)
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file([line("a", {"prompt": "word " * 500}, url=COMPLETIONS),
                          line("b", {"prompt": "word " * 500, "max_tokens": 16}, url=COMPLETIONS)],
                         model=MODEL, path="in.jsonl", checker=checker)
    assert str(caught.value).splitlines() == [
        "in.jsonl: line 1: body.max_tokens: prompt (501 tokens) plus max_tokens=16 is 517 tokens, more than "
        "max_model_len=512; the line gives no max_tokens: 16 is OpenAI's completions default",
        "in.jsonl: line 2: body.max_tokens: prompt (501 tokens) plus max_tokens=16 is 517 tokens, more than "
        "max_model_len=512",
        "in.jsonl: 2 bad lines; nothing was stored"]
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file([line("a", chat("word " * 470))], model=MODEL, path="in.jsonl", checker=checker)
    assert str(caught.value).splitlines() == [
        "in.jsonl: line 1: body.max_tokens: prompt (501 tokens) plus max_tokens=16 is 517 tokens, more than "
        "max_model_len=512; the line gives no max_tokens or max_completion_tokens: 16 is weir's default",
        "in.jsonl: 1 bad line; nothing was stored"]


def test_an_error_names_the_field_as_the_line_spells_it():
    assert refusal([line("a", chat(max_completion_tokens=0)), line("b", chat(logprobs=True, top_logprobs=-1)),
                    line("c", {"messages": "Hi"})]) == [
        "line 1: body.max_completion_tokens: must be an integer >= 1, got 0",
        "line 2: body.top_logprobs: must be None or >= 0, got -1",
        'line 3: body.messages: must be a list of chat messages ({"role": ..., "content": ...})',
    ]


def test_chat_batch_round_trips_as_openai_types(session_factory):
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletion

    batch_id, (ok, bad) = store_batch(session_factory, [line("r1", chat(logprobs=True, top_logprobs=1)),
                                                        line("r2", chat("Hello"))])
    completions = [{"index": 0, "text": "Tea.", "finish_reason": "stop", "stop_reason": None, "num_tokens": 2,
                    "cumulative_logprob": -0.5, "parsed": None,
                    # as stored: the sampled token, then the top one unless it is the sampled one
                    "logprobs": [[entry(5, -0.25, "Tea", rank=1)],
                                 [entry(7, -1.0, ".", rank=2), entry(8, -0.5, "!", rank=1)]]}]
    finish(session_factory, ok, JobResult(status=JobStatus.SUCCEEDED, output_text="Tea.", finish_reason="stop",
                                          completions=completions, num_prompt_tokens=9, num_completion_tokens=2,
                                          num_cached_tokens=4))
    finish(session_factory, bad, JobResult.failure("engine failed"))

    out, err = result_lines(session_factory, batch_id)
    body = ChatCompletion.model_validate(out["response"]["body"])
    assert (out["custom_id"], out["response"]["status_code"], out["response"]["request_id"], out["error"]) == (
        "r1", 200, str(ok.id), None)
    assert (body.object, body.model, body.choices[0].message.content, body.choices[0].finish_reason) == (
        "chat.completion", MODEL, "Tea.", "stop")
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens,
            body.usage.prompt_tokens_details.cached_tokens) == (9, 2, 11, 4)
    tokens = body.choices[0].logprobs.content
    assert [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs]) for t in tokens] == [
        ("Tea", -0.25, [("Tea", -0.25)]), (".", -1.0, [("!", -0.5)])]
    assert err == {"id": f"batch_req_{bad.id.hex}", "custom_id": "r2", "response": None,
                   "error": {"code": "job_failed", "message": "engine failed"}}
    assert openai_batch.is_error(err) and not openai_batch.is_error(out)

    batch = openai.types.Batch.model_validate(openai_batch.batch_object(status_of(session_factory, batch_id)))
    assert (batch.object, batch.endpoint, batch.input_file_id, batch.completion_window, batch.status,
            batch.metadata) == ("batch", CHAT_COMPLETIONS, "in.jsonl", "24h", "completed", {"team": "search"})
    assert batch.request_counts == openai.types.BatchRequestCounts(total=2, completed=1, failed=1)
    assert batch.expires_at - batch.created_at == 24 * 3600 and batch.completed_at is not None


def test_completion_and_classification_results_validate(session_factory):
    openai = pytest.importorskip("openai")

    batch_id, [job] = store_batch(session_factory, [line("c", {"prompt": "Tea is", "max_tokens": 3}, url=COMPLETIONS)])
    finish(session_factory, job, JobResult(status=JobStatus.SUCCEEDED, output_text=" hot", finish_reason="length",
                                           num_prompt_tokens=3, num_completion_tokens=3))
    [out] = result_lines(session_factory, batch_id)
    body = openai.types.Completion.model_validate(out["response"]["body"])
    assert (body.object, body.choices[0].text, body.choices[0].finish_reason, body.usage.total_tokens) == (
        "text_completion", " hot", "length", 6)

    batch_id, [job] = store_batch(session_factory, [line("k", {"prompt": "Green tea", "labels": ["tea", "coffee"]},
                                                         url=CLASSIFICATIONS)])
    finish(session_factory, job, JobResult(status=JobStatus.SUCCEEDED, label="tea",
                                           label_probs={"tea": 0.75, "coffee": 0.25}, num_prompt_tokens=4))
    [out] = result_lines(session_factory, batch_id)
    assert {k: out["response"]["body"][k] for k in ("object", "label", "label_probs", "usage")} == {
        "object": "classification", "label": "tea", "label_probs": {"tea": 0.75, "coffee": 0.25},
        "usage": {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}}


def test_status_mapping():
    meta = openai_batch.batch_metadata(CHAT_COMPLETIONS, "in.jsonl", "24h")
    assert {status.value: openai_batch.openai_status(status, meta) for status in BatchStatus} == {
        "validating": "validating", "queued": "in_progress", "in_progress": "in_progress",
        "completed": "completed", "failed": "completed", "cancelled": "cancelled"}
    expired = {**meta, "openai_batch": {**meta["openai_batch"], "expired_at": 1}}
    assert openai_batch.openai_status(BatchStatus.CANCELLED, expired) == "expired"


def test_a_batch_past_its_window_expires_and_its_unrun_requests_are_cancelled(session_factory):
    openai = pytest.importorskip("openai")

    batch_id, (done, waiting) = store_batch(session_factory, [line("a", chat()), line("b", chat())], window="2h")
    finish(session_factory, done, JobResult(status=JobStatus.SUCCEEDED, output_text="x", finish_reason="stop",
                                            num_prompt_tokens=1, num_completion_tokens=1))
    created_at = status_of(session_factory, batch_id).created_at
    created_at = created_at if created_at.tzinfo else created_at.replace(tzinfo=timezone.utc)  # naive on SQLite
    with session_factory.begin() as session:
        assert not openai_batch.expire_if_due(session, batch_id, now=created_at + timedelta(minutes=119))
    assert status_of(session_factory, batch_id).status == BatchStatus.IN_PROGRESS
    with session_factory.begin() as session:
        assert openai_batch.expire_if_due(session, batch_id, now=created_at + timedelta(hours=2))
    batch = openai.types.Batch.model_validate(openai_batch.batch_object(status_of(session_factory, batch_id)))
    assert (batch.status, batch.expired_at, batch.request_counts.completed, batch.request_counts.total) == (
        "expired", int((created_at + timedelta(hours=2)).timestamp()), 1, 2)
    out, err = result_lines(session_factory, batch_id)
    assert out["response"]["status_code"] == 200 and err["error"]["code"] == "batch_expired"
    with session_factory.begin() as session:  # expired once; a finished batch never expires
        assert not openai_batch.expire_if_due(session, batch_id, now=created_at + timedelta(hours=3))


@pytest.mark.parametrize("expire", [False, True])
def test_a_cancelled_request_that_had_started_is_said_to_be_cancelled_before_it_finished(session_factory, expire):
    batch_id, (running, waiting) = store_batch(session_factory, [line("a", chat()), line("b", chat())], window="2h")
    with session_factory.begin() as session:
        support.claim_job(session, running.id)
    with session_factory.begin() as session:
        if expire:
            created_at = batches.get_batch(session, batch_id).created_at
            assert openai_batch.expire_if_due(session, batch_id, now=created_at + timedelta(hours=2))
        else:
            batches.cancel_batch(session, batch_id)
    with session_factory() as session:
        assert [(j.status, j.attempts, j.started_at is not None) for j in batches.list_jobs(session, batch_id)] == [
            (JobStatus.CANCELLED, 1, True), (JobStatus.CANCELLED, 0, False)]
    code, why = (("batch_expired", "the batch's completion window passed before this request")
                 if expire else ("batch_cancelled", "the batch was cancelled before this request"))
    assert [(r["custom_id"], r["error"]) for r in result_lines(session_factory, batch_id)] == [
        ("a", {"code": code, "message": f"{why} finished"}), ("b", {"code": code, "message": f"{why} ran"})]


def test_batch_metadata_follows_openai_rules():
    with pytest.raises(ValueError, match="completion window '1d' is not a duration like 24h, 90m or 3600s"):
        openai_batch.batch_metadata(CHAT_COMPLETIONS, "in.jsonl", "1d")
    with pytest.raises(ValueError, match="metadata has 17 pairs; at most 16"):
        openai_batch.check_metadata({str(i): "v" for i in range(17)})
    with pytest.raises(ValueError, match="metadata key 'openai_batch' is weir's own"):
        openai_batch.check_metadata({"openai_batch": "x"})


def test_a_completion_window_of_zero_is_refused_as_not_positive():
    for window in ("0s", "0h", "00m"):
        with pytest.raises(ValueError) as refused:
            openai_batch.parse_completion_window(window)
        assert str(refused.value) == f"completion window {window!r} must be positive (24h, 90m, 3600s)"
    assert openai_batch.parse_completion_window("90m") == timedelta(minutes=90)


def test_the_sweep_rule_expires_only_the_models_request_file_batches_past_their_window(session_factory):
    model = f"expiry-{uuid.uuid4().hex[:8]}"  # the Postgres database is shared with other tests
    due, _ = store_batch(session_factory, [line("a", chat())], window="1h", model=model)
    later, _ = store_batch(session_factory, [line("a", chat())], window="3h", model=model)
    with session_factory.begin() as session:
        plain, _ = support.create_batch(session, [GenerateRequest(prompt="Hi")], model=model)
        other, _ = support.create_batch(session, [GenerateRequest(prompt="Hi")], model=f"other-{uuid.uuid4().hex[:8]}",
                                        metadata=openai_batch.batch_metadata(CHAT_COMPLETIONS, "in.jsonl", "1h"))
        plain, other = plain.id, other.id
    created_at = status_of(session_factory, due).created_at
    now = (created_at if created_at.tzinfo else created_at.replace(tzinfo=timezone.utc)) + timedelta(hours=2)
    with session_factory.begin() as session:
        assert openai_batch.expire_due_batches(session, model=model, now=now) == 1
    with session_factory.begin() as session:  # once
        assert openai_batch.expire_due_batches(session, model=model, now=now) == 0
    assert [status_of(session_factory, b).status for b in (due, later, plain, other)] == [
        BatchStatus.CANCELLED, BatchStatus.QUEUED, BatchStatus.QUEUED, BatchStatus.QUEUED]


@pytest.mark.parametrize("url", [CHAT_COMPLETIONS, COMPLETIONS])
def test_top_logprobs_from_the_engine_hold_the_k_most_likely_tokens_the_sampled_one_among_them(
        session_factory, tiny_model_dir, url):
    """Real engine output (two greedy completions of 4 tokens, 2 top tokens asked), stored as the
    worker stores it and read back with the ``openai`` types: every position lists exactly the 2
    most likely tokens, most likely first, the sampled one among them when it ranks within 2."""
    openai = pytest.importorskip("openai")
    from weir.engine import LLM
    from weir.worker.runtime import _completion

    if url == CHAT_COMPLETIONS:
        body = chat("Name a fruit.", logprobs=True, top_logprobs=2, n=2, temperature=0, max_tokens=4)
    else:
        body = {"model": MODEL, "prompt": "Name a fruit.", "logprobs": 2, "n": 2, "temperature": 0,
                "max_tokens": 4}
    batch_id, [job] = store_batch(session_factory, [line("r1", body, url=url)])
    request = parse_batch_file([line("r1", body, url=url)], model=MODEL).requests[0]
    llm = LLM(model=tiny_model_dir, max_model_len=256)
    [output] = llm.generate([request.engine_prompt()], request.sampling_params())
    completions = [_completion(c, wants_json=False) for c in output.outputs]
    finish(session_factory, job, JobResult(status=JobStatus.SUCCEEDED, output_text=completions[0]["text"],
                                           finish_reason="length", completions=completions, num_prompt_tokens=1,
                                           num_completion_tokens=8))
    [out] = result_lines(session_factory, batch_id)
    stored = [position for c in completions for position in c["logprobs"]]
    assert len(stored) == 8
    if url == CHAT_COMPLETIONS:
        body = openai.types.chat.ChatCompletion.model_validate(out["response"]["body"])
        listed = [t for choice in body.choices for t in choice.logprobs.content]
        assert [len(t.top_logprobs) for t in listed] == [2] * 8
        for t, entries in zip(listed, stored):
            sampled = entries[0]
            assert [e.logprob for e in t.top_logprobs] == sorted((e.logprob for e in t.top_logprobs), reverse=True)
            assert (t.logprob in [e.logprob for e in t.top_logprobs]) == (sampled["rank"] <= 2)
            assert t.top_logprobs[0].logprob == max(e["logprob"] for e in entries)
    else:
        body = openai.types.Completion.model_validate(out["response"]["body"])
        listed = [top for choice in body.choices for top in choice.logprobs.top_logprobs]
        for top, entries in zip(listed, stored):
            tokens = {e["decoded_token"] for e in top_entries_of(entries, 2)}
            assert set(top) == tokens and len(tokens) <= 2  # keys are decoded strings: two ids may share one


def top_entries_of(entries, k):
    """The k most likely of a stored position, straight from its ranks."""
    return sorted({e["token_id"]: e for e in entries}.values(), key=lambda e: e["rank"])[:k]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize("url, body", [
    (CHAT_COMPLETIONS, chat("Name a fruit.", n=2, stop=["."], temperature=0.7, seed=1, max_tokens=6,
                            response_format={"type": "json_object"})),
    (CHAT_COMPLETIONS, chat("Name a fruit.", n=2, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3,
                            response_format={"type": "json_schema",
                                             "json_schema": {"name": "fruit", "schema": SCHEMA}})),
    (COMPLETIONS, {"model": MODEL, "prompt": "A fruit:", "n": 2, "stop": ["\n"], "temperature": 0.7, "seed": 2,
                   "max_tokens": 6, "logprobs": 1}),
], ids=["chat-json-object-stop", "chat-json-schema-logprobs", "completions-stop-logprobs"])
def test_every_object_of_a_batch_run_by_the_engine_is_valid_for_the_openai_types(session_factory, tiny_model_dir,
                                                                                  url, body):
    """Conformance: the Batch object before and after its request ran, and the output line's body
    (n = 2 choices from the real engine, as the worker stores them), validated by the ``openai``
    package's own types, with exact choice and top-logprob counts."""
    openai = pytest.importorskip("openai")
    from weir.engine import LLM
    from weir.worker.runtime import _completion

    batch_id, [job] = store_batch(session_factory, [line("r1", body, url=url)])
    assert openai.types.Batch.model_validate(
        openai_batch.batch_object(status_of(session_factory, batch_id))).status == "in_progress"
    request = parse_batch_file([line("r1", body, url=url)], model=MODEL).requests[0]
    [output] = LLM(model=tiny_model_dir, max_model_len=256).generate([request.engine_prompt()],
                                                                      request.sampling_params())
    completions = [_completion(c, wants_json=request.response_format is not None) for c in output.outputs]
    finish(session_factory, job, JobResult(
        status=JobStatus.SUCCEEDED, output_text=completions[0]["text"], finish_reason=completions[0]["finish_reason"],
        completions=completions, num_prompt_tokens=len(output.prompt_token_ids),
        num_completion_tokens=sum(c["num_tokens"] for c in completions)))
    batch = openai.types.Batch.model_validate(openai_batch.batch_object(status_of(session_factory, batch_id)))
    assert (batch.status, batch.request_counts.completed, batch.request_counts.total) == ("completed", 1, 1)
    [out] = result_lines(session_factory, batch_id)
    types = openai.types
    parsed = (types.chat.ChatCompletion if url == CHAT_COMPLETIONS else types.Completion).model_validate(
        out["response"]["body"])
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.usage.completion_tokens == sum(c["num_tokens"] for c in completions)
    num_top = body.get("top_logprobs", body.get("logprobs") if url == COMPLETIONS else None)
    for choice, stored in zip(parsed.choices, completions):
        if url == CHAT_COMPLETIONS:
            assert choice.message.content == stored["text"]
            tops = None if choice.logprobs is None else [len(t.top_logprobs) for t in choice.logprobs.content]
        else:
            assert choice.text == stored["text"]
            tops = None if choice.logprobs is None else [len(t) for t in choice.logprobs.top_logprobs]
        assert tops == (None if num_top is None else [num_top] * stored["num_tokens"])
