"""What a caller may ask for: pydantic request models, validated before anything is stored or sent.

A request is stored as JSON in the ``weir.jobs.request`` column and parsed back by the worker with
:func:`parse_request`, so both sides agree on one schema. Sampling fields carry vLLM's names and
ranges (``engine.SamplingParams``).

How a prompt reaches the model: a plain string without ``system_prompt`` is run as raw text
(a completion); a list of chat messages, or any string with a ``system_prompt``, goes through the
model's chat template with the generation prompt appended.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

MAX_CUSTOM_ID_CHARS = 256
MAX_PRODUCT_ID_CHARS = 64  # product_enrichment.product_id is VARCHAR(64)
MAX_SEED = 2**63 - 1
MAX_TEXT_CHARS = 1_000_000
"""Longest prompt, system prompt, message or label text a request may carry, in characters.

Larger texts are refused when the request is built, before anything is stored or published (a
prompt this long could not fit any model's context anyway)."""

MAX_JSON_INT = 2**63 - 1


def check_json(value: Any, path: str) -> None:
    """Check that ``value`` is plain JSON, as the database stores it and a reader gets it back.

    Allowed: ``str``, ``bool``, ``None``, ``int`` within 64-bit range, finite ``float``, and
    ``list``/``tuple``/``dict`` of those (dict keys must be ``str``). Nothing is converted: bytes,
    datetimes, sets, numpy scalars, NaN and Infinity are refused, so what is read back is exactly
    what was given.

    Args:
        value: the value to check.
        path: its name in error messages, e.g. ``"metadata"``.

    Raises:
        ValueError: naming the first offending field, e.g.
            ``metadata['when'] is a datetime.datetime, not a JSON value (str, int, float, bool,
            None, list, dict)``.
    """
    if value is None or isinstance(value, (str, bool)):
        return
    if type(value) is int:
        if not -MAX_JSON_INT - 1 <= value <= MAX_JSON_INT:
            raise ValueError(f"{path} = {value} is outside the 64-bit integer range")
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"{path} is {value!r}; JSON has no NaN or Infinity (use None)")
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_json(item, f"{path}[{i}]")
        return
    if type(value) is dict:
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path} has a key {key!r} of type {_type_name(key)}; JSON keys are strings")
            check_json(item, f"{path}[{key!r}]")
        return
    raise ValueError(
        f"{path} is a {_type_name(value)}, not a JSON value (str, int, float, bool, None, list, dict)"
    )


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class ChatMessage(BaseModel):
    """One chat turn, as in OpenAI's and vLLM's chat APIs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)


def _prompt_form(value: Any) -> str:
    return "text" if isinstance(value, str) else "messages"


# Tagged by its Python type, so an error names one branch: ("prompt", "messages", 0, "content").
Prompt = Annotated[
    Union[Annotated[Text, Tag("text")], Annotated[list[ChatMessage], Tag("messages")]],
    Discriminator(_prompt_form),
]


class _JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    system_prompt: Optional[str] = Field(None, min_length=1, max_length=MAX_TEXT_CHARS)
    custom_id: Optional[str] = Field(None, min_length=1, max_length=MAX_CUSTOM_ID_CHARS)
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free JSON kept with the job (see :func:`check_json` for what it may hold)."""

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError("prompt is empty")
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt has no messages")
        return prompt

    def engine_prompt(self) -> Union[str, list[dict[str, str]]]:
        """The prompt in the form ``engine.LLM.encode_prompt`` takes.

        Returns:
            The string itself for a raw prompt; otherwise chat messages as dicts, the system prompt
            first.
        """
        if isinstance(self.prompt, str) and self.system_prompt is None:
            return self.prompt
        messages = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        if isinstance(self.prompt, str):
            messages.append({"role": "user", "content": self.prompt})
        else:
            messages.extend(m.model_dump() for m in self.prompt)
        return messages

    @field_validator("metadata", mode="plain")
    @classmethod
    def _product_id_fits(cls, metadata: Any) -> dict[str, Any]:
        if type(metadata) is not dict:
            raise ValueError(f"metadata must be a dict, not {_type_name(metadata)}")
        check_json(metadata, "metadata")
        value = metadata.get("product_id")
        if value is not None:
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise ValueError("metadata.product_id must be a string or an integer")
            if not 0 < len(str(value)) <= MAX_PRODUCT_ID_CHARS:
                raise ValueError(f"metadata.product_id must have 1 to {MAX_PRODUCT_ID_CHARS} characters")
        return metadata

    @property
    def product_id(self) -> Optional[str]:
        """``metadata["product_id"]`` as a string, when the job enriches a catalog product."""
        value = self.metadata.get("product_id")
        return None if value is None else str(value)


class GenerateRequest(_JobRequest):
    """Generate a continuation of ``prompt``.

    Sampling fields have vLLM's names and ranges: ``temperature >= 0`` (0 = greedy),
    ``0 < top_p <= 1``, ``top_k`` of -1/0 (off) or ``>= 1``, ``max_tokens >= 1``, ``seed >= 0``.
    """

    kind: Literal["generate"] = "generate"
    # strict: a bool or a numeric string is refused, not coerced (the engine refuses them too)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, strict=True)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, strict=True)
    top_k: int = Field(0, ge=-1, strict=True)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED, strict=True)
    max_tokens: int = Field(16, ge=1, strict=True)

    def sampling_fields(self) -> dict[str, Any]:
        """Keyword arguments for ``engine.SamplingParams``."""
        return self.model_dump(include={"temperature", "top_p", "top_k", "seed", "max_tokens"})


class ClassifyRequest(_JobRequest):
    """Pick the label the model finds most likely as a continuation of ``prompt``.

    ``labels`` must be non-empty, each label non-blank, no label repeated.
    ``label_texts`` (optional, one per label) is the text scored for each label instead of the
    label itself followed by EOS. ``calibration_prompt`` (optional) is a content-free prompt in the
    same form as ``prompt`` (``"N/A"`` in place of the input): scores are then calibrated against
    it (Zhao et al. 2021), which removes a small model's bias toward some answers.
    """

    kind: Literal["classify"] = "classify"
    labels: list[Text] = Field(min_length=1)
    label_texts: Optional[list[Text]] = None
    calibration_prompt: Optional[Prompt] = None

    @model_validator(mode="after")
    def _label_texts_match(self) -> "ClassifyRequest":
        if self.label_texts is not None:
            if len(self.label_texts) != len(self.labels):
                raise ValueError(f"label_texts has {len(self.label_texts)} entries for {len(self.labels)} labels")
            if any(not t.strip() for t in self.label_texts):
                raise ValueError("label_texts must not be blank")
        return self

    def engine_calibration_prompt(self) -> Union[str, list[dict[str, str]], None]:
        """``calibration_prompt`` rendered like :meth:`engine_prompt` (same system prompt)."""
        if self.calibration_prompt is None:
            return None
        return self.model_copy(update={"prompt": self.calibration_prompt}).engine_prompt()

    @field_validator("labels")
    @classmethod
    def _labels_distinct(cls, labels: list[str]) -> list[str]:
        if any(not label.strip() for label in labels):
            raise ValueError("labels must not be blank")
        seen: set[str] = set()
        repeated = [label for label in labels if label in seen or seen.add(label)]
        if repeated:
            raise ValueError(f"labels must be distinct, repeated: {sorted(set(repeated))}")
        return labels


JobRequest = Union[GenerateRequest, ClassifyRequest]

_REQUEST_MODELS: dict[str, type[_JobRequest]] = {"generate": GenerateRequest, "classify": ClassifyRequest}


class _RequestKind(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: Literal["generate", "classify"]


def parse_request(data: Union[dict[str, Any], GenerateRequest, ClassifyRequest]) -> JobRequest:
    """Validate one request given as a dict (with a ``kind`` key) or as a request model.

    Raises:
        pydantic.ValidationError: ``kind`` missing or not ``generate``/``classify`` (loc
            ``("kind",)``), or any invalid field of that kind (loc ``("prompt",)``, ``("labels",)``...).
    """
    if isinstance(data, (GenerateRequest, ClassifyRequest)):
        return data
    kind = _RequestKind.model_validate(data).kind
    return _REQUEST_MODELS[kind].model_validate(data)
