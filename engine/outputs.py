"""What the engine returns (vLLM's ``RequestOutput`` / ``CompletionOutput``), plus classification."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    """A token's log-probability (nats, finite: see ``weir.engine.sampling_params.LOGPROB_SENTINEL``),
    its rank among all tokens (1 = most likely) and its text alone."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# one position: token id -> Logprob (the chosen token, then the top-N)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: sample index within the request (0 .. n-1).
        text: detokenized output, special tokens skipped unless asked otherwise; cut before a
            matched stop string unless ``include_stop_str_in_output``.
        token_ids: generated token ids, EOS included when the request stopped on it.
        finish_reason: ``"stop"`` (EOS, a stop token id or a stop string), ``"length"``
            (max_tokens or max_model_len), ``"abort"`` (aborted or past its deadline), or None
            while unfinished.
        stop_reason: the stop token id or stop string that ended it; None for EOS and others.
        cumulative_logprob: sum of the generated tokens' log-probabilities when ``logprobs`` was
            asked for, else None.
        logprobs: per generated token, when asked: the sampled token and the top ``logprobs``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[PositionLogprobs]] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request, in vLLM's shape.

    Attributes:
        request_id: the engine's id of the request.
        prompt: prompt text when a string was given, else None.
        prompt_token_ids: the token ids that were run.
        outputs: the completions (one for ``n == 1``).
        finished: True once every completion has a finish_reason.
        num_cached_tokens: prompt tokens served from the prefix cache (not recomputed).
        metrics: timings in seconds since the epoch: ``arrival_time``, ``first_scheduled_time``,
            ``first_token_time``, ``finished_time``; and durations in seconds:
            ``queue_time_s`` (arrival to first scheduled), ``time_to_first_token_s`` and
            ``e2e_latency_s`` (from arrival).
        prompt_logprobs: when asked: None for the first prompt token, then for each prompt token
            its log-probability given the tokens before it, plus the top ``prompt_logprobs``.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None


@dataclass
class ClassificationOutput:
    """Choice scoring of one prompt against a label set.

    Attributes:
        label: the label with the highest score.
        probs: every label's probability (softmax of the scores over the label set), summing to 1,
            in the order the labels were given.
        logprobs: each label's summed token log-probability as a continuation of the prompt (nats).
        num_prompt_tokens: tokens in the prompt.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_label_tokens: label tokens computed (all labels together).
        request_id: the engine's id of the request.
    """

    label: str
    probs: dict[str, float]
    logprobs: dict[str, float]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_label_tokens: int
    request_id: str = ""


def calibrate(output: ClassificationOutput, prior: ClassificationOutput) -> ClassificationOutput:
    """Contextual calibration (Zhao et al. 2021, "Calibrate Before Use"): subtract each label's
    log-probability under a content-free prompt (``prior``) from its score, then renormalize.

    Small models favour some answers whatever the input; dividing by that prior removes the bias.

    Returns:
        A new output whose ``logprobs`` are the calibrated scores (nats) and ``probs`` their softmax.

    Raises:
        ValueError: the two outputs score different label sets.
    """
    if list(output.logprobs) != list(prior.logprobs):
        raise ValueError("calibration prior scores a different label set")
    scores = {lab: output.logprobs[lab] - prior.logprobs[lab] for lab in output.logprobs}
    return ClassificationOutput(max(scores, key=scores.get), softmax(scores), scores,
                                output.num_prompt_tokens, output.num_cached_tokens,
                                output.num_label_tokens, output.request_id)


def softmax(scores: dict[str, float]) -> dict[str, float]:
    """Probabilities from log-space scores (nats), same keys and order, summing to 1."""
    m = max(scores.values())
    z = sum(math.exp(v - m) for v in scores.values())
    return {lab: math.exp(v - m) / z for lab, v in scores.items()}
