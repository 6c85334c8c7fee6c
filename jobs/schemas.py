"""What a caller may ask for: pydantic request models, validated before anything is stored or sent.

A request is stored as JSON in the ``weir.jobs.request`` column and parsed back by the worker with
:func:`parse_request`, so both sides agree on one schema. A generation's sampling fields are every
field of ``weir.engine.SamplingParams``, with its names and defaults, and are checked by building
one: its ranges and its error messages, nothing restated here.

How a prompt reaches the model: a plain string without ``system_prompt`` is run as raw text
(a completion); a list of chat messages, or any string with a ``system_prompt``, goes through the
model's chat template with the generation prompt appended.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, SkipValidation, Tag, ValidationError, ValidationInfo, field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from weir.engine.sampling_params import SamplingParams, StructuredOutputsParams

MAX_CUSTOM_ID_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_TEXT_CHARS = 1_000_000
"""Longest prompt, system prompt, message or label text a request may carry, in characters.

Larger texts are refused when the request is built, before anything is stored or published (a
prompt this long could not fit any model's context anyway)."""

MAX_JSON_INT = 2**63 - 1


def check_json(value: Any, path: str) -> None:
    """Check that ``value`` is plain JSON, as the database stores it and a reader gets it back.

    Allowed: ``str`` without NUL characters (Postgres' ``json`` functions cannot read ``\u0000``),
    ``bool``, ``None``, ``int`` within 64-bit range, finite ``float``, and ``list``/``tuple``/``dict``
    of those (dict keys must be such strings). Nothing is converted: bytes, datetimes, sets, numpy
    scalars, NaN and Infinity are refused, so what is read back is exactly what was given.

    Args:
        value: the value to check.
        path: its name in error messages, e.g. ``"metadata"``.

    Raises:
        ValueError: naming the first offending field, e.g.
            ``metadata['when'] is a datetime.datetime, not a JSON value (str, int, float, bool,
            None, list, dict)``.
    """
    if isinstance(value, str):
        _check_no_nul(value, path)
        return
    if value is None or isinstance(value, bool):
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
            _check_no_nul(key, f"{path} key {key!r}")
            check_json(item, f"{path}[{key!r}]")
        return
    raise ValueError(
        f"{path} is a {_type_name(value)}, not a JSON value (str, int, float, bool, None, list, dict)"
    )


def _check_no_nul(text: str, path: str) -> None:
    if "\x00" in text:
        raise ValueError(f"{path} contains a NUL character (\\x00) at index {text.index(chr(0))}; "
                         "the database cannot store it in JSON")


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


MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1
Priority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True)]
"""A job's scheduling priority (vLLM's meaning: lower runs first), a 32-bit integer: the one check,
for a request's ``priority`` and for ``Client.enqueue_batch(priority=)`` alike."""
INTERACTIVE_PRIORITY = 0
"""A job enqueued on its own or in a batch with no priority given."""
BULK_PRIORITY = 9
"""A catalog enrichment batch (``weir enrich``, the nightly run): runs after interactive jobs, on the
broker (kombu's Redis priority level 9, polled after level 0) and in the engine."""


@functools.lru_cache(maxsize=1)
def request_extensions() -> dict[str, Any]:
    """The pydantic models of request extensions, by name, from the installed applications
    (:data:`weir.jobs.applications.REQUEST_EXTENSIONS`)."""
    from weir.jobs import applications

    return applications.load(applications.REQUEST_EXTENSIONS)


class _JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    system_prompt: Optional[str] = Field(None, min_length=1, max_length=MAX_TEXT_CHARS)
    custom_id: Optional[str] = Field(None, min_length=1, max_length=MAX_CUSTOM_ID_CHARS)
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free JSON kept with the job (see :func:`check_json` for what it may hold)."""
    extensions: dict[str, Any] = Field(default_factory=dict)
    """Data applications keep with the job, by name: each value is checked by the pydantic model
    its application registers (entry-point group ``weir.request_extensions``; the catalog's
    ``enrichment``, :class:`weir.jobs.catalog.marker.Enrichment`) and stored as that model dumps it.
    The core stores it and hands the job back to the application's result projection and post-run
    policy; a name no installed application registers is refused."""
    priority: Priority = 0
    """The engine's scheduling priority (vLLM's: lower runs first; with
    ``WEIR_SCHEDULING_POLICY=priority``); set for a whole batch by ``Client.enqueue_batch(priority=)``,
    whose messages also go to the broker's priority level for it."""

    @model_validator(mode="after")
    def _registered_extensions(self) -> "_JobRequest":
        """Each extension checked by its application's model, kept as that model dumps it, then
        checked against this request (the model's ``check_request``). Errors carry the location
        ``("extensions", name, ...)``."""
        if not self.extensions:
            return self
        models = request_extensions()
        for name, value in list(self.extensions.items()):
            model = models.get(name)
            if model is None:
                raise _field_error(f"extensions.{name}", value, f"extensions.{name}: no installed application "
                                   f"registers it (registered: {', '.join(models) or 'none'})")
            try:
                extension = model.model_validate(value)
            except ValidationError as exc:
                error = exc.errors()[0]
                where = ".".join(["extensions", name, *map(str, error["loc"])])
                raise _field_error(where, error.get("input"), f"{where}: {error['msg']}") from None
            try:
                extension.check_request(self)
            except ValueError as exc:
                field = str(exc).split(":", 1)[0]
                raise _field_error(f"extensions.{name}.{field}", value, f"extensions.{name}.{exc}") from None
            self.extensions[name] = extension.model_dump(mode="json", exclude_none=True)
        return self

    @field_validator("prompt", "calibration_prompt", mode="before", check_fields=False)
    @classmethod
    def _prompt_is_a_string_or_messages(cls, prompt: Any, info: ValidationInfo) -> Any:
        # Anything else would be reported as a malformed list of chat messages.
        if isinstance(prompt, (str, list, tuple)) or (prompt is None and info.field_name != "prompt"):
            return prompt
        if isinstance(prompt, dict):
            keys = ", ".join(repr(k) for k in prompt) or "none"
            raise ValueError(f"a prompt is a string or a list of chat messages ({{'role': ..., 'content': ...}}), "
                             f"not a dict (keys {keys})")
        raise ValueError(f"a prompt is a string or a list of chat messages ({{'role': ..., 'content': ...}}), "
                         f"not {'None' if prompt is None else type(prompt).__name__}")

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
    def _metadata_is_json(cls, metadata: Any) -> dict[str, Any]:
        if type(metadata) is not dict:
            raise ValueError(f"metadata must be a dict, not {_type_name(metadata)}")
        check_json(metadata, "metadata")
        return metadata

    @field_validator("prompt", "system_prompt", "custom_id", "labels", "label_texts", "calibration_prompt",
                     mode="after", check_fields=False)
    @classmethod
    def _no_nul(cls, value: Any, info: Any) -> Any:
        items = [value] if isinstance(value, str) else list(value or [])
        texts = [t if isinstance(t, str) else getattr(t, "content", None) for t in items]
        for text in filter(lambda t: isinstance(t, str), texts):
            _check_no_nul(text, info.field_name)
        return value


_ENGINE_DEFAULTS = SamplingParams()
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
"""The sampling fields a generation carries: every field of ``weir.engine.SamplingParams``."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: a named JSON Schema the output must follow."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (free text), ``{"type": "json_object"}``
    (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``.
    vLLM serves it as ``structured_outputs`` (``json_object`` or ``json``), and so does weir."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given_for_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema: {name, schema}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type} takes no json_schema")
        if self.json_schema is not None:
            check_json(self.json_schema.schema_, "response_format.json_schema.schema")
        return self

    def structured_outputs(self) -> Optional[dict[str, Any]]:
        """The ``StructuredOutputsParams`` dict this format asks for (None for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


WHITESPACE_OPTION = "disable_any_whitespace"
"""The constraint's field (vLLM's ``StructuredOutputsParams`` name) that says whether JSON may hold
free whitespace between its tokens."""

_JSON_KINDS = ("json", "json_object")


def job_constraint(structured_outputs: Optional[dict[str, Any]],
                   response_format: Optional["ResponseFormat"]) -> Optional[dict[str, Any]]:
    """The constraint a job's output is compiled under: ``structured_outputs``, or the one
    ``response_format`` asks for with ``structured_outputs``' whitespace option laid over it.

    A job's JSON (``json`` or ``json_object``) is compact unless the request says otherwise:
    ``disable_any_whitespace`` is true when the request does not give it (free whitespace costs a
    small model tokens and says nothing). ``{"disable_any_whitespace": false}`` keeps xgrammar's
    free whitespace, as the engine's own default (the offline ``LLM``) does. None: no constraint.
    """
    constraint = dict(structured_outputs or {})
    if response_format is not None:
        asked = response_format.structured_outputs()
        if asked is None:
            return None
        constraint = {**asked, **constraint}
    if not constraint:
        return None
    if any(constraint.get(kind) not in (None, False) for kind in _JSON_KINDS):
        constraint.setdefault(WHITESPACE_OPTION, True)
    return constraint


# The engine's messages start with the field they refuse ("max_tokens must be ...",
# "structured_outputs.json is not supported: ..."); a response_format's name its own field instead.
_RESPONSE_FORMAT_NAMES = {"structured_outputs.json": "response_format.json_schema.schema",
                          "structured_outputs.json_object": "response_format"}


class GenerateRequest(_JobRequest):
    """Generate ``n`` continuations of ``prompt``.

    The sampling fields are ``weir.engine.SamplingParams``' own (``n``, ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``seed``, ``max_tokens``, ``min_tokens``, ``stop``, ``stop_token_ids``,
    ``include_stop_str_in_output``, ``ignore_eos``, the three penalties, ``logprobs``,
    ``prompt_logprobs``, the two special-token switches, ``structured_outputs``), with its defaults;
    they are checked by building a ``SamplingParams``, so its ranges and its errors apply, each
    error reported at the field it names. They are stored as the engine normalises them (``stop``
    a list, ``top_k`` 0 when off).

    ``response_format`` (OpenAI's shapes, see :class:`ResponseFormat`) is another way to ask for
    ``structured_outputs``; giving both is refused, except ``structured_outputs`` holding only
    ``disable_any_whitespace``. JSON output is compact unless ``disable_any_whitespace`` is false
    (:func:`job_constraint`); the stored ``structured_outputs`` names the choice. A schema, regex or grammar the engine's
    backend cannot compile is refused here too, naming the field
    (``response_format.json_schema.schema is not supported: ...``).
    """

    kind: Literal["generate"] = "generate"
    # SkipValidation: the types document the fields; SamplingParams checks them (model validator).
    n: SkipValidation[int] = _ENGINE_DEFAULTS.n
    temperature: SkipValidation[float] = _ENGINE_DEFAULTS.temperature
    top_p: SkipValidation[float] = _ENGINE_DEFAULTS.top_p
    top_k: SkipValidation[int] = _ENGINE_DEFAULTS.top_k
    min_p: SkipValidation[float] = _ENGINE_DEFAULTS.min_p
    seed: SkipValidation[Optional[int]] = _ENGINE_DEFAULTS.seed
    max_tokens: SkipValidation[int] = _ENGINE_DEFAULTS.max_tokens
    min_tokens: SkipValidation[int] = _ENGINE_DEFAULTS.min_tokens
    stop: SkipValidation[Optional[Union[str, list[str]]]] = Field(default_factory=list)
    stop_token_ids: SkipValidation[list[int]] = Field(default_factory=list)
    include_stop_str_in_output: SkipValidation[bool] = _ENGINE_DEFAULTS.include_stop_str_in_output
    ignore_eos: SkipValidation[bool] = _ENGINE_DEFAULTS.ignore_eos
    presence_penalty: SkipValidation[float] = _ENGINE_DEFAULTS.presence_penalty
    frequency_penalty: SkipValidation[float] = _ENGINE_DEFAULTS.frequency_penalty
    repetition_penalty: SkipValidation[float] = _ENGINE_DEFAULTS.repetition_penalty
    logprobs: SkipValidation[Optional[int]] = _ENGINE_DEFAULTS.logprobs
    prompt_logprobs: SkipValidation[Optional[int]] = _ENGINE_DEFAULTS.prompt_logprobs
    skip_special_tokens: SkipValidation[bool] = _ENGINE_DEFAULTS.skip_special_tokens
    spaces_between_special_tokens: SkipValidation[bool] = _ENGINE_DEFAULTS.spaces_between_special_tokens
    structured_outputs: SkipValidation[Optional[dict[str, Any]]] = None
    response_format: Optional[ResponseFormat] = None

    @model_validator(mode="after")
    def _engine_accepts_sampling_fields(self) -> "GenerateRequest":
        if (self.response_format is not None and self.structured_outputs is not None
                and set(self.structured_outputs) - {WHITESPACE_OPTION}):
            raise _field_error("structured_outputs", self.structured_outputs,
                               "structured_outputs: give response_format or structured_outputs, not both")
        try:
            params = self.sampling_params()
            if params.structured_outputs is not None:
                _check_constraint(params.structured_outputs)
        except ValueError as exc:
            message = str(exc)
            if self.response_format is not None:
                engine_name = message.split(" ", 1)[0]
                if engine_name in _RESPONSE_FORMAT_NAMES:  # named as the request gave it
                    message = _RESPONSE_FORMAT_NAMES[engine_name] + message[len(engine_name):]
            name = message.split(" ", 1)[0].rstrip(":")
            raise _field_error(name, getattr(self, name.split(".")[0], None), message) from None
        for name in SAMPLING_FIELDS:
            if name != "structured_outputs":
                setattr(self, name, getattr(params, name))
        if self.structured_outputs is not None and self.response_format is None:
            constraint = params.structured_outputs
            self.structured_outputs = constraint.to_dict()
            if constraint.kind in _JSON_KINDS:  # explicit both ways: a stored job reads back the same
                self.structured_outputs[WHITESPACE_OPTION] = constraint.disable_any_whitespace
            check_json(self.structured_outputs, "structured_outputs")
        return self

    def _engine_fields(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        fields["structured_outputs"] = job_constraint(self.structured_outputs, self.response_format)
        return fields

    def sampling_params(self) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request (``response_format`` mapped to
        ``structured_outputs``, JSON compact unless asked otherwise: :func:`job_constraint`)."""
        return SamplingParams(**self._engine_fields())

    def params_with(self, overrides: dict[str, Any]) -> SamplingParams:
        """This request's ``SamplingParams`` with the fields of ``overrides`` replaced: a further run
        an application asks for (the catalog's description retry).

        Raises:
            TypeError, ValueError: as ``SamplingParams`` does for the merged fields.
        """
        return SamplingParams(**{**self._engine_fields(), **overrides})

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling fields by their engine names, as stored (JSON)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}

    @property
    def wants_json(self) -> bool:
        """Whether the output is asked to be JSON (``json`` or ``json_object`` constraint)."""
        if self.response_format is not None:
            return self.response_format.type != "text"
        return self.structured_outputs is not None and bool(
            {"json", "json_object"} & {k for k, v in self.structured_outputs.items() if v not in (None, False)})


def _field_error(name: str, value: Any, message: str) -> ValidationError:
    """A ValidationError at the field ``name`` (dotted for a nested one) with the engine's message."""
    loc = tuple(name.split(".")) if name.split(".")[0] in GenerateRequest.model_fields else ()
    return ValidationError.from_exception_data("JobRequest", [InitErrorDetails(
        type=PydanticCustomError("sampling_params", "{message}", {"message": message}), loc=loc, input=value)])


def _check_constraint(spec: StructuredOutputsParams) -> None:
    """Compile a constraint with the engine's backend (``weir.engine.structured_outputs.check``,
    which remembers the constraints that passed).

    Raises:
        ValueError: the backend cannot compile it; the message names the field
            (``structured_outputs.json ...``). Imports xgrammar and torch, so only requests that
            carry a constraint pay for them.
    """
    from weir.engine.structured_outputs import check

    check(spec)


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
