"""``WorkerRuntime.run`` for generations on the tiny chat model: every sampling field reaches the
engine, every completion is stored as the engine returned it, and a job that cannot fit
``max_model_len`` fails at once with the reason."""

import uuid

import pytest

from tests import support
from weir import migrations
from weir.config import CacheSettings, DatabaseSettings, EngineSettings, Settings, WorkerSettings
from weir.jobs.db import Job, JobKind, JobStatus
from weir.jobs.schemas import GenerateRequest
from weir.worker.runtime import WorkerRuntime


@pytest.fixture(scope="module")
def runtime(tiny_model_dir, tmp_path_factory):
    db_path = tmp_path_factory.mktemp("db") / "weir.db"
    migrations.upgrade(f"sqlite:///{db_path}")
    settings = Settings(
        engine=EngineSettings(model=tiny_model_dir, device="cpu", max_num_seqs=4),
        cache=CacheSettings(cpu_kv_cache_bytes=8 << 20),
        worker=WorkerSettings(job_timeout_s=60),
        database=DatabaseSettings(sqlite_path=str(db_path)),
    )
    runtime = WorkerRuntime(settings)
    runtime.start()
    yield runtime
    runtime.shutdown(drain=False)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """The engine alone, on the same model: what a job must store."""
    from weir.engine import LLM

    return LLM(model=tiny_model_dir, device="cpu", max_num_seqs=4)


def as_job(request):
    return Job(id=uuid.uuid4(), kind=JobKind.GENERATE, request=request.model_dump(mode="json", exclude_none=True))


def stored_completion(c):
    """A ``CompletionOutput`` as ``jobs.completions`` holds it (see ``weir.jobs.db.Job``)."""
    return {
        "index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        "num_tokens": len(c.token_ids), "cumulative_logprob": c.cumulative_logprob,
        "logprobs": [[{"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                      for t, lp in position.items()] for position in c.logprobs],
        "parsed": None,
    }


def test_every_sampling_field_reaches_the_engine_and_every_completion_is_stored(runtime, llm):
    fields = dict(prompt="Once upon a time", n=2, temperature=0.8, seed=11, min_tokens=2, max_tokens=12,
                  presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logprobs=2)
    free = llm.generate([fields["prompt"]], GenerateRequest(**fields).sampling_params())[0].outputs[0]
    stop = free.logprobs[5][free.token_ids[5]].decoded_token  # the text of its 6th token
    assert stop.strip()
    request = GenerateRequest(stop=stop, **fields)

    result = runtime.run(as_job(request))

    [want] = llm.generate([request.engine_prompt()], request.sampling_params())
    completions = [stored_completion(c) for c in want.outputs]
    assert len(completions) == 2 and completions[0]["stop_reason"] == stop
    assert completions[0]["finish_reason"] == "stop" and completions[0]["num_tokens"] <= 6
    assert all(len(position) in (1, 2, 3) for c in completions for position in c["logprobs"])
    assert (result.status, result.output_text, result.finish_reason) == (
        JobStatus.SUCCEEDED, want.outputs[0].text, "stop")
    assert result.completions == completions
    assert (result.parsed, result.prompt_logprobs) == (None, None)
    assert result.num_completion_tokens == sum(len(c.token_ids) for c in want.outputs)
    assert result.num_prompt_tokens == len(want.prompt_token_ids)

    with runtime.session_factory.begin() as session:
        _, [job] = support.create_batch(session, [request], model="tiny")
    with runtime.session_factory.begin() as session:
        job = support.claim_job(session, job.id)
    with runtime.session_factory.begin() as session:
        assert support.record_result(session, job, result)
    with runtime.session_factory() as session:
        row = session.get(Job, job.id)
    assert (row.output_text, row.completions, row.num_completion_tokens) == (
        want.outputs[0].text, completions, result.num_completion_tokens)
    assert row.request["stop"] == [stop] and row.request["n"] == 2 and row.request["logprobs"] == 2


def test_penalties_reach_the_engine(runtime, llm):
    request = GenerateRequest(prompt="Once upon a time", temperature=0, max_tokens=12, presence_penalty=1.0,
                              frequency_penalty=0.5, repetition_penalty=1.2, logprobs=0)
    result = runtime.run(as_job(request))
    [want] = llm.generate([request.engine_prompt()], request.sampling_params())
    assert result.completions == [stored_completion(want.outputs[0])]
    # Greedy without penalties repeats one token: the penalties are what changed it.
    plain = runtime.run(as_job(GenerateRequest(prompt="Once upon a time", temperature=0, max_tokens=12, logprobs=0)))
    assert len({position[0]["token_id"] for position in plain.completions[0]["logprobs"]}) == 1
    assert len({position[0]["token_id"] for position in result.completions[0]["logprobs"]}) > 1


def test_prompt_logprobs_are_stored_per_prompt_token(runtime, llm):
    request = GenerateRequest(prompt="Hello there friend", temperature=0, max_tokens=2, prompt_logprobs=1)
    result = runtime.run(as_job(request))
    [want] = llm.generate([request.engine_prompt()], request.sampling_params())
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(want.prompt_token_ids)
    assert result.prompt_logprobs[1:] == [
        [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
         for t, lp in position.items()] for position in want.prompt_logprobs[1:]]


@pytest.mark.parametrize("prompt, max_tokens, error", [
    ("One two", 10**9, "ValueError: max_tokens=1000000000 is more than max_model_len=512"),
    ("One two", 511, "ValueError: prompt (2 tokens) plus max_tokens=511 is 513 tokens, more than max_model_len=512"),
])
def test_a_job_beyond_max_model_len_fails_at_once_with_the_reason(runtime, prompt, max_tokens, error):
    before = runtime.front.stats()["num_requests_running"] + runtime.front.stats()["num_requests_waiting"]
    result = runtime.run(as_job(GenerateRequest(prompt=prompt, max_tokens=max_tokens)), timeout_s=5)
    assert (result.status, result.error, result.output_text) == (JobStatus.FAILED, error, None)
    assert before == 0 and runtime.front.stats()["num_requests_running"] == 0
    # One token fewer fits, and runs.
    assert runtime.run(as_job(GenerateRequest(prompt=prompt, max_tokens=2, temperature=0))).status == JobStatus.SUCCEEDED


def completion(text, finish_reason):
    from weir.engine.outputs import CompletionOutput, RequestOutput

    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2],
                         outputs=[CompletionOutput(index=0, text=text, token_ids=[5, 6, 2], finish_reason=finish_reason)],
                         finished=True)


@pytest.mark.parametrize("asks, text, finish_reason, parsed", [
    ({"response_format": {"type": "json_object"}}, '{"a": [1, "x"]}', "stop", {"a": [1, "x"]}),
    ({"structured_outputs": {"json": {"type": "object"}}}, '{"a": 1}', "stop", {"a": 1}),
    ({"response_format": {"type": "json_object"}}, '{"a": [1, "x"]}', "length", None),  # cut by max_tokens
    ({"response_format": {"type": "json_object"}}, '{"a": ', "stop", None),
    ({}, '{"a": 1}', "stop", None),  # not asked for JSON
    ({"structured_outputs": {"regex": "[a-z{}]+"}}, "{}", "stop", None),
])
def test_parsed_is_set_only_for_json_asked_finished_and_parsing(runtime, asks, text, finish_reason, parsed):
    result = runtime._generated(completion(text, finish_reason), GenerateRequest(prompt="x", **asks))
    assert (result.parsed, result.completions[0]["parsed"], result.output_text) == (parsed, parsed, text)


def test_a_flagged_description_is_written_once_more_and_the_clean_attempt_kept(runtime, llm):
    """The tiny random model writes no sentence, so the first attempt is flagged: the retry
    sampling runs and, neither being clean, the first is kept, with both attempts' tokens counted."""
    from weir.jobs.catalog.quality import OK, description_quality

    fields = dict(prompt="Product: Green Tea\nBrand: Leafy", temperature=0.0, max_tokens=8)
    retry = {"repetition_penalty": 1.1, "frequency_penalty": 0.3}
    request = GenerateRequest(**fields, extensions={"enrichment": {"catalog": "c", "product_id": "1", "retry_sampling": retry}})
    first = llm.generate([request.engine_prompt()], request.sampling_params())[0]
    second = llm.generate([request.engine_prompt()], request.params_with(retry))[0]
    assert request.params_with(retry).frequency_penalty == 0.3 and request.params_with(retry).max_tokens == 8
    assert description_quality(first.outputs[0].text) != OK and first.outputs[0].text != second.outputs[0].text
    result = runtime.run(as_job(request))
    kept = second if description_quality(second.outputs[0].text) == OK else first
    assert result.output_text == kept.outputs[0].text
    assert result.num_completion_tokens == len(first.outputs[0].token_ids) + len(second.outputs[0].token_ids)
    assert result.num_prompt_tokens == 2 * len(first.prompt_token_ids)
    # without retry_sampling: one attempt
    plain = runtime.run(as_job(GenerateRequest(**fields, extensions={"enrichment": {"catalog": "c", "product_id": "1"}})))
    assert (plain.output_text, plain.num_completion_tokens) == (first.outputs[0].text, len(first.outputs[0].token_ids))
