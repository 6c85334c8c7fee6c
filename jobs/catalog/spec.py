"""The catalog job's spec: a TOML file naming a catalog's columns, its shop, its taxonomy, the
prompts and the decoding parameters. Read with :func:`load_spec`; every field has a default that
reads sensibly for any shop, so a spec names only what differs.

Layout (every table and key optional)::

    [columns]                 # CSV column names; brand and description are optional: a column
    id = "index"; name = "product"; brand = "brand"; description = "description"
                              # the CSV lacks (or "") leaves the field empty and out of the prompts

    [domain]
    shop = "an online shop"   # how prompts name the seller: "a copywriter for {shop}"

    [taxonomy]
    source = "column"         # "column": the catalog's own labels; "file": a taxonomy file
    column = "category"       # source = "column": the label column
    json_list = false         # the cell is a JSON list whose first string is the label path
    separator = ""            # the label is a path "A >> B >> C" split on this ("" = no path)
    level = 1                 # keep the path's first `level` parts
    hint_column = ""          # a column of sub-labels shown as hints (paths: the next level)
    file = ""                 # source = "file": "id - A > B > C" lines (Google's taxonomy), relative
                              # to the spec file's folder

    [classify]
    method = "exemplars"      # "exemplars": k nearest labelled products as few-shot lines;
                              # "zero_shot": the label with its hints, calibrated against "N/A";
                              # "knn": the vote of the nearest labelled products, no model;
                              # "hybrid": that vote where its share >= vote_threshold, else exemplars
    num_exemplars = 4
    num_neighbours = 10       # knn, hybrid: how many nearest labelled products vote
    vote_threshold = 0.0      # knn: a vote share below this is review; hybrid: the vote decides at
                              # and above it (above 0), the model below
    header = "Products of {shop} and their categories."
    review_below = 0.0        # a category whose probability is below this is review (0: never)

    [describe]
    system_prompt = "..."     # {shop}
    user_prompt = "..."       # {name}, {brand}, {description} (the source description's first
                              # description_chars characters); a line whose field is empty is left out
    description_chars = 400

    [describe.sampling]       # any engine SamplingParams field; keys not given keep these
    temperature = 0.0; max_tokens = 96; stop = ["\\n", ". ", "! ", "? "]
    include_stop_str_in_output = true; repetition_penalty = 1.2

    [describe.retry_sampling] # a flagged description is written once more with these replaced
    repetition_penalty = 1.1; frequency_penalty = 0.3   # (an empty table: no second attempt)

    [extract]                 # attribute extraction: a third job per product when fields are named
    system_prompt = "..."     # {shop}
    description_chars = 400   # the listing shows the name and this much of the description
    [extract.fields]          # field = its JSON Schema (inline table); each is made nullable and
    brand = { type = "string", minLength = 1, maxLength = 40 }   # required, in this order
    [[extract.examples]]      # worked examples shown before every product (a cached prefix);
    name = "..."              # default: two general ones (a bottle, a shirt), keeping the values
    description = "..."       # of fields they know that the field's schema accepts
    values = { brand = "Acme" }   # a field not given is null in the example
    [extract.evidence]        # field = what shows its value right (weir.jobs.catalog.decisions):
    brand = "brand"           # "listing" (the default), "brand", "colour", "material", "audience",
                              # "count" or "none" (nothing does: always review)
    [extract.sampling]        # any SamplingParams field but structured_outputs (the job sets it)
    temperature = 0.0; max_tokens = 128; logprobs = 0
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from weir.jobs.catalog.grounding import EvidenceKind

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

SPECS_DIR = os.path.join(os.path.dirname(__file__), "specs")
"""The shipped specs (``bigbasket.toml``, ``flipkart.toml``), installed with the package."""

DESCRIBE_SYSTEM_PROMPT = (
    "You are a copywriter for {shop}. For the product the user names, write exactly one sentence "
    "for its product page. Say what the product is and why a shopper would want it, in a warm, "
    "factual tone, and mention the brand once. Use only the facts of the listing the user gives: "
    "do not invent prices, numbers, sizes, materials, colours, places, brands, ingredients, "
    "certifications or health claims, do not use lists, emojis or quotation marks, and write "
    "nothing after the sentence."
)
DESCRIBE_USER_PROMPT = ("Product: {name}\nBrand: {brand}\nListing: {description}\n\nWrite one full sentence, not "
                        "a title, that tells a shopper what this product is and why they would want it, using only "
                        "facts from the listing.")
"""Chosen by measurement (BENCHMARKS.md, descriptions): asked for "the one-sentence description",
the model often wrote the product's title back as a heading line, which the line-break stop cut
unfinished; asking for a full sentence that is not a title, addressed to a shopper, leaves fewer
(Flipkart 14 to 9 of 200, BigBasket 10 to 5)."""
DESCRIBE_SAMPLING = dict(temperature=0.0, max_tokens=96, stop=["\n", ". ", "! ", "? "],
                         include_stop_str_in_output=True, repetition_penalty=1.2)
"""Chosen by measurement (BENCHMARKS.md, catalog quality): end at the first sentence end or line
break, keep the full stop, and penalise repeats; a listing of the fields alone made the model echo
them in loops. A frequency or presence penalty in place of the repetition penalty loops more, a
repetition penalty of 1.1 or 1.3 alone ends fewer sentences, and 1.1 with frequency_penalty 0.3
tied with this over 800 products; without the line-break stop an echoed title is followed by more
lines, not a sentence."""
CLASSIFY_HEADER = "Products of {shop} and their categories."

EXTRACT_SYSTEM_PROMPT = (
    "You read the product listings of {shop} and extract their attributes as JSON. Copy each value "
    "from the listing as written; use null for an attribute the listing does not state."
)
EXTRACT_EXAMPLES = (
    {"name": "Acme Steel Water Bottle, 750 ml (Pack of 2)",
     "description": "Acme presents a leak-proof steel water bottle in blue. Keeps drinks cold for 12 hours.",
     "values": {"brand": "Acme", "type": "Water Bottle", "color": "Blue", "colour": "Blue", "material": "Steel",
                "quantity": 750, "unit": "ml", "pack_of": 2, "pack_size": 2}},
    {"name": "Zorro Men's Solid Casual Cotton Shirt",
     "description": "A regular fit shirt for men from Zorro, in cotton, with a spread collar.",
     "values": {"brand": "Zorro", "type": "Shirt", "material": "Cotton", "ideal_for": "Men", "gender": "Men"}},
)
"""Two unlike products, so that a small model copies values from the listing rather than from the
examples (BENCHMARKS.md, "Attribute extraction"); each fills only the fields a spec names."""
EXTRACT_SAMPLING = dict(temperature=0.0, max_tokens=128, logprobs=0)
"""``logprobs = 0``: the sampled tokens' log-probabilities, read as each value's confidence
(``product_enrichment.attributes_confidence``)."""


class SpecError(ValueError):
    """A spec file that cannot be used; the message names the file and the offending key."""


OPTIONAL_COLUMNS = ("brand", "description")
"""The :class:`Columns` fields a catalog may lack: a product without them is named by its id and
name alone, and prompts leave out the lines they would fill."""


class _Table(BaseModel):
    """One TOML table of a spec: every key optional, no other key, values of exactly their type
    (pydantic, strict: ``id = 5`` is not a column name)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Columns(_Table):
    """The catalog's CSV column names; ``""`` for an optional one (:data:`OPTIONAL_COLUMNS`) says
    the catalog has no such column."""

    id: str = "index"
    name: str = "product"
    brand: str = "brand"
    description: str = "description"


class Domain(_Table):
    shop: str = "an online shop"


class Taxonomy(_Table):
    source: Literal["column", "file"] = "column"
    column: str = "category"
    json_list: bool = False
    separator: str = ""
    level: int = Field(1, ge=1)
    hint_column: str = ""
    file: str = ""

    @model_validator(mode="after")
    def _file_named(self) -> "Taxonomy":
        if self.source == "file" and not self.file:
            raise ValueError('[taxonomy] file must name a taxonomy file when source = "file"')
        return self


VOTE_METHODS = ("knn", "hybrid")
"""The ``[classify]`` methods in which the nearest-neighbour vote decides categories without a model."""


class Classify(_Table):
    method: Literal["knn", "hybrid", "exemplars", "zero_shot"] = "exemplars"
    """How a product's category is chosen: ``knn``, the vote of its ``num_neighbours`` nearest
    labelled products alone (no model); ``hybrid``, that vote where its share is at least
    ``vote_threshold``, else ``exemplars``; ``exemplars``, the model scoring each label after the
    ``num_exemplars`` nearest labelled products; ``zero_shot``, the model alone, calibrated."""
    num_exemplars: int = Field(4, ge=1)
    num_neighbours: int = Field(10, ge=1)
    """How many nearest labelled products vote (``knn``, ``hybrid``)."""
    vote_threshold: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """The vote's share (its label's summed similarity over all the neighbours') at and above which
    the vote's category is ``auto`` (``knn``: below it ``review``, ``low_confidence``) or decides
    without the model (``hybrid``, which needs it above 0)."""
    header: str = CLASSIFY_HEADER
    review_below: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """A category whose probability (the model's) is below this is ``review`` (``low_confidence``); 0: never."""

    @model_validator(mode="after")
    def _keys_of_the_method(self) -> "Classify":
        if self.method == "hybrid" and self.vote_threshold <= 0:
            raise ValueError("[classify] method = \"hybrid\" needs vote_threshold above 0 (at 0 the vote "
                             "decides every product: method = \"knn\")")
        unused = sorted(self.model_fields_set & (
            {"num_neighbours", "vote_threshold"} if self.method not in VOTE_METHODS
            else {"num_exemplars", "review_below"} if self.method == "knn" else set()))
        if unused:
            raise ValueError(f"[classify] {unused[0]} does nothing under method = {self.method!r} "
                             f"({CLASSIFY_KEYS_USED[unused[0]]}): remove it, or choose that method")
        return self


CLASSIFY_KEYS_USED = {
    "num_neighbours": "used by knn and hybrid", "vote_threshold": "used by knn and hybrid",
    "num_exemplars": "used by exemplars and hybrid", "review_below": "the model's probability: exemplars, "
    "zero_shot and hybrid"}
"""Which ``[classify]`` methods read each method-specific key (a spec that sets one its method
ignores is refused)."""


DESCRIBE_RETRY_SAMPLING = dict(repetition_penalty=1.1, frequency_penalty=0.3)
"""The sampling fields replaced in a flagged description's second attempt: the runner-up of the
measured configurations (BENCHMARKS.md, descriptions), whose flagged products differ."""


def _checked_sampling(label: str, value: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with the keys of the ``[label]`` table, checked by building the
    engine's SamplingParams (its ranges and messages apply).

    Raises:
        ValueError: ``[label]`` is not a table, names a key SamplingParams lacks (or
            ``structured_outputs``: the job sets it), or SamplingParams refuses a value.
    """
    if not isinstance(value, dict):
        raise ValueError(f"[{label}] must be a table")
    from weir.engine.sampling_params import SamplingParams

    known = {f.name for f in dataclasses.fields(SamplingParams)} - {"structured_outputs"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"[{label}] has unknown key {unknown[0]!r} (SamplingParams fields: {', '.join(sorted(known))})")
    merged = {**defaults, **value}
    try:
        SamplingParams(**merged)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"[{label}] {exc}") from None
    return merged


class Describe(_Table):
    system_prompt: str = DESCRIBE_SYSTEM_PROMPT
    user_prompt: str = DESCRIBE_USER_PROMPT
    description_chars: int = Field(400, ge=0)
    """How much of the source description the prompt shows (whitespace collapsed)."""
    sampling: dict[str, Any] = Field(default_factory=lambda: dict(DESCRIBE_SAMPLING))
    """Sampling fields; keys a spec does not give keep :data:`DESCRIBE_SAMPLING`'s."""
    retry_sampling: dict[str, Any] = Field(default_factory=lambda: dict(DESCRIBE_RETRY_SAMPLING))
    """A flagged description (:func:`weir.jobs.catalog.quality.description_quality` not ``ok``) is written
    once more with these sampling fields replaced, and the first clean attempt is kept; empty: no
    second attempt."""

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling(cls, value: Any) -> dict[str, Any]:
        return _checked_sampling("describe.sampling", value, DESCRIBE_SAMPLING)

    @field_validator("retry_sampling", mode="before")
    @classmethod
    def _retry_sampling(cls, value: Any, info: ValidationInfo) -> dict[str, Any]:
        sampling = info.data.get("sampling", DESCRIBE_SAMPLING)
        _checked_sampling("describe.retry_sampling", value, sampling)
        return dict(value)


class Extract(_Table):
    """Attribute extraction: with ``fields`` named, every product gets a third job whose output is
    constrained to :attr:`schema` (structured outputs) and stored as ``product_enrichment.attributes``."""

    system_prompt: str = EXTRACT_SYSTEM_PROMPT
    description_chars: int = Field(400, ge=0)
    fields: dict[str, Any] = Field(default_factory=dict)
    """Field name -> its JSON Schema, in the spec's order."""
    examples: list[dict[str, Any]] = Field(default_factory=list)
    """``{"name", "description", "values"}`` each; empty: :data:`EXTRACT_EXAMPLES`."""
    sampling: dict[str, Any] = Field(default_factory=lambda: dict(EXTRACT_SAMPLING))
    evidence: dict[str, EvidenceKind] = Field(default_factory=dict)
    """Field name -> what shows its value right (:data:`weir.jobs.catalog.decisions.EVIDENCE_KINDS`);
    a field not named: ``listing``."""

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling(cls, value: Any) -> dict[str, Any]:
        return _checked_sampling("extract.sampling", value, EXTRACT_SAMPLING)

    @field_validator("fields", mode="before")
    @classmethod
    def _fields(cls, value: Any) -> dict[str, Any]:
        """Each a JSON Schema (an inline table) the structured-outputs backend enforces."""
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            bad = next((k for k, v in value.items() if not isinstance(v, dict)), None) if isinstance(value, dict) else None
            raise ValueError("[extract.fields] must map each field name to its JSON Schema, an inline "
                             'table such as { type = "string" }' + (f"; {bad} is {value[bad]!r}" if bad else ""))
        from weir.engine.structured_outputs import unsupported_schema_keyword

        for name, sub in value.items():
            if not name.strip():
                raise ValueError("[extract.fields] has an empty field name")
            found = unsupported_schema_keyword(sub, f"#/{name}")
            if found:
                raise ValueError(f"[extract.fields] {name}: keyword {found} is not supported")
        return dict(value)

    @field_validator("examples", mode="before")
    @classmethod
    def _examples(cls, value: Any) -> list[dict[str, Any]]:
        """``[[extract.examples]]``: tables of a name, a description and values."""
        if not isinstance(value, list):
            raise ValueError("[[extract.examples]] must be an array of tables")
        out = []
        for i, example in enumerate(value):
            if not isinstance(example, dict) or set(example) - {"name", "description", "values"}:
                raise ValueError(f"[[extract.examples]] #{i + 1} must be a table of name, description, values")
            if not isinstance(example.get("name"), str) or not isinstance(example.get("description", ""), str):
                raise ValueError(f"[[extract.examples]] #{i + 1} needs a name and a description (strings)")
            if not isinstance(example.get("values", {}), dict):
                raise ValueError(f"[[extract.examples]] #{i + 1} values must be a table")
            out.append({"name": example["name"], "description": example.get("description", ""),
                        "values": dict(example.get("values", {}))})
        return out

    @model_validator(mode="after")
    def _compiles(self) -> "Extract":
        """The schema compiles (xgrammar, as the engine will), and the examples name only its
        fields with values it accepts."""
        if self.examples and not self.fields:
            raise ValueError("[[extract.examples]] given without [extract.fields]")
        if not self.enabled:
            return self
        from weir.engine.sampling_params import StructuredOutputsParams
        from weir.engine.structured_outputs import check

        for name, sub in self.fields.items():  # each alone first, so that the error names the field
            try:
                check(StructuredOutputsParams(json=sub))
            except ValueError as exc:
                reason = str(exc).split(" is not supported: ", 1)[-1]
                raise ValueError(f"[extract.fields] {name}: not a schema the grammar can enforce: {reason}") from None
        try:
            check(StructuredOutputsParams(json=self.schema))
        except ValueError as exc:
            raise ValueError(f"[extract.fields] {exc}") from None
        stray = sorted(set(self.evidence) - set(self.fields))
        if stray:
            raise ValueError(f"[extract.evidence] {stray[0]!r} is not one of [extract.fields]")
        for i, example in enumerate(self.examples):
            stray = sorted(set(example["values"]) - set(self.fields))
            if stray:
                raise ValueError(f"[[extract.examples]] #{i + 1} value {stray[0]!r} is not one of [extract.fields]")
        import jsonschema

        validator = jsonschema.Draft202012Validator(self.schema)
        for i, (_, _, answer) in enumerate(self.worked_examples()):
            for name, value in answer.items():
                found = None if value is None else jsonschema.exceptions.best_match(
                    jsonschema.Draft202012Validator(self.fields[name]).iter_errors(value))
                if found is not None:
                    raise ValueError(f"[[extract.examples]] #{i + 1} value {name}: {found.message}")
            error = jsonschema.exceptions.best_match(validator.iter_errors(answer))
            if error is not None:
                at = "/".join(map(str, error.absolute_path))
                raise ValueError(f"[[extract.examples]] #{i + 1} value {at}: {error.message}")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.fields)

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON Schema of one product's attributes: an object with every field required, in
        the spec's order, each nullable (``anyOf`` with ``null``: the listing may not say), and no
        other property."""
        return {"type": "object", "additionalProperties": False, "required": list(self.fields),
                "properties": {name: {"anyOf": [sub, {"type": "null"}]} for name, sub in self.fields.items()}}

    @functools.cached_property
    def _worked_examples(self) -> list[tuple[str, str, dict[str, Any]]]:
        return self._build_worked_examples()

    def worked_examples(self) -> list[tuple[str, str, dict[str, Any]]]:
        """See :meth:`_build_worked_examples`; built once per spec (every product's prompt shows them)."""
        return self._worked_examples

    def _build_worked_examples(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(name, description, answer) of each worked example; the answer has every field in
        order, null where the example gives no value. With no ``examples`` in the spec, those of
        :data:`EXTRACT_EXAMPLES`, keeping each value only when its field's schema accepts it."""
        import jsonschema

        if self.examples:
            return [(e["name"], e["description"], {k: e["values"].get(k) for k in self.fields})
                    for e in self.examples]
        out = []
        for e in EXTRACT_EXAMPLES:
            values = {k: e["values"].get(k) for k in self.fields}
            out.append((e["name"], e["description"],
                        {k: v if v is not None and jsonschema.Draft202012Validator(self.fields[k]).is_valid(v) else None
                         for k, v in values.items()}))
        return out


class JobSpec(_Table):
    """A whole spec; ``JobSpec()`` is the default one. Its tables are read from TOML by
    :func:`parse_spec` (pydantic models: frozen, no unknown key, values of exactly their type)."""

    columns: Columns = Columns()
    domain: Domain = Domain()
    taxonomy: Taxonomy = Taxonomy()
    classify: Classify = Classify()
    describe: Describe = Describe()
    extract: Extract = Extract()
    path: Optional[str] = None

    @model_validator(mode="after")
    def _a_vote_needs_labelled_products(self) -> "JobSpec":
        if self.classify.method in VOTE_METHODS and self.taxonomy.source != "column":
            raise ValueError(f"[classify] method = {self.classify.method!r} needs labelled products to vote: "
                             "[taxonomy] source = \"column\"")
        return self

    def with_columns(self, **names: Optional[str]) -> "JobSpec":
        """The spec with the given column names replaced (None keeps the spec's)."""
        changed = {k: v for k, v in names.items() if v is not None}
        return self.model_copy(update={"columns": self.columns.model_copy(update=changed)})

    def required_columns(self) -> dict[str, str]:
        """The columns a catalog must have, by role: ``id``, ``name``, and with labels from a
        column ``category`` (the taxonomy's column) and ``hint`` (its hint column, when named)."""
        required = {"id": self.columns.id, "name": self.columns.name}
        if self.taxonomy.source == "column":
            required["category"] = self.taxonomy.column
            if self.taxonomy.hint_column:
                required["hint"] = self.taxonomy.hint_column
        return required


_TABLES = ("columns", "domain", "taxonomy", "classify", "describe", "extract")
_TYPE_NAMES = {"string_type": "a string", "int_type": "an integer", "bool_type": "a boolean"}


def _spec_error(where: str, error: dict[str, Any]) -> SpecError:
    """One pydantic error of :func:`parse_spec` as a line naming the spec's table and key."""
    loc, kind, value = error["loc"], error["type"], error.get("input")
    table = loc[0] if loc else ""
    key = loc[1] if len(loc) > 1 else None
    if kind == "value_error":
        return SpecError(f"{where}: {error['ctx']['error']}")
    if kind == "extra_forbidden" and key is None:
        return SpecError(f"{where}: unknown table [{table}] (known: {', '.join(_TABLES)})")
    model = JobSpec.model_fields[table].annotation if table in _TABLES else JobSpec
    if kind == "extra_forbidden":
        return SpecError(f"{where}: [{table}] has unknown key {key!r} (known: {', '.join(model.model_fields)})")
    if key is None:  # the table itself: model_type (not a table)
        return SpecError(f"{where}: [{table}] must be a table, got {value!r}")
    if kind == "literal_error" and len(loc) > 2:  # a value of a table of choices: [extract.evidence]
        return SpecError(f"{where}: [{table}.{key}] {loc[2]} must be one of {error['ctx']['expected']}, got {value!r}")
    if kind == "literal_error":
        choices = typing.get_args(model.model_fields[key].annotation)
        return SpecError(f"{where}: [{table}] {key} must be one of {', '.join(choices)}, got {value!r}")
    if kind == "greater_than_equal":
        return SpecError(f"{where}: [{table}] {key} must be >= {error['ctx']['ge']}, got {value!r}")
    if kind == "less_than_equal":
        return SpecError(f"{where}: [{table}] {key} must be <= {error['ctx']['le']}, got {value!r}")
    if kind == "finite_number":
        return SpecError(f"{where}: [{table}] {key} must be a finite number, got {value!r}")
    if kind in _TYPE_NAMES:
        return SpecError(f"{where}: [{table}] {key} must be {_TYPE_NAMES[kind]}, got {value!r}")
    return SpecError(f"{where}: [{table}] {key}: {error['msg']}")


def parse_spec(data: dict[str, Any], where: str = "spec") -> JobSpec:
    """A spec from its parsed TOML tables.

    Raises:
        SpecError: an unknown table or key, a value of the wrong type or outside its choices, a
            sampling field SamplingParams refuses, an inconsistent taxonomy, or extraction fields
            the grammar cannot enforce; the message starts with ``where`` and names the key (the
            first such error).
    """
    if "path" in data:
        raise SpecError(f"{where}: unknown table [path] (known: {', '.join(_TABLES)})")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(where, exc.errors()[0]) from None


def shipped_specs() -> list[str]:
    """The names of the shipped specs (``--spec NAME``), sorted: ``["bigbasket", "flipkart"]``."""
    return sorted(name[:-len(".toml")] for name in os.listdir(SPECS_DIR) if name.endswith(".toml"))


def fitting_specs(header: list[str]) -> list[str]:
    """The shipped specs (sorted names) whose required columns (:meth:`JobSpec.required_columns`)
    are all in ``header``, a catalog's header row."""
    return [name for name in shipped_specs()
            if all(column in header for column in load_spec(name).required_columns().values())]


def load_spec(path: Optional[str] = None) -> JobSpec:
    """Read a spec file; ``None`` gives the default spec. A bare name (``"flipkart"``) is a shipped
    spec from :data:`SPECS_DIR`. A relative taxonomy ``file`` is resolved against the spec's folder.

    Raises:
        SpecError: the file is missing (for a bare name: ``no shipped spec 'x' (shipped:
            bigbasket, flipkart); or give the path of a TOML spec file``), is not TOML, or holds
            a bad key (see :func:`parse_spec`).
    """
    if path is None:
        return JobSpec()
    if os.sep not in path and not path.endswith(".toml"):
        name, path = path, os.path.join(SPECS_DIR, f"{path}.toml")
        if not os.path.isfile(path):
            raise SpecError(f"no shipped spec {name!r} (shipped: {', '.join(shipped_specs())}); or give the "
                            "path of a TOML spec file (layout in jobs/catalog/spec.py)")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML ({exc})") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise SpecError(f"{path}: not valid TOML, which is UTF-8 (byte offset {exc.start}: {exc.reason})") from None
    spec = parse_spec(data, where=path)
    if spec.taxonomy.file and not os.path.isabs(spec.taxonomy.file):
        resolved = os.path.join(os.path.dirname(os.path.abspath(path)), spec.taxonomy.file)
        spec = spec.model_copy(update={"taxonomy": spec.taxonomy.model_copy(update={"file": resolved})})
    return spec.model_copy(update={"path": path})
