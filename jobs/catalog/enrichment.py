"""Catalog enrichment: per product one classification job, one description job and, when the
job spec names ``[extract.fields]``, one attribute extraction job; and their summary.

What a catalog looks like, and how it is prompted and decoded, comes from a job spec
(:mod:`weir.jobs.catalog.spec`: columns, shop words, taxonomy, prompts, sampling). The catalog is a CSV
file read with the csv module, UTF-8 unless told otherwise; a byte that is not valid in its encoding
is refused, naming the line, never replaced. Real dirt is kept as it is (mojibake already in the
text, empty descriptions) except for surrounding whitespace, which is stripped from every field (363
BigBasket brands end in spaces).

Every request of a kind starts with the same fixed text (the description's system prompt, the
classification header, the extraction's system prompt and worked example), so the engine's prefix
cache serves it.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import json
import os
from collections import Counter
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from weir.jobs.catalog.decisions import AUTO, judge_category
from weir.jobs.catalog.exemplars import ExemplarIndex, Labelled
from weir.jobs.catalog.extraction import extraction_messages
from weir.jobs.catalog.grounding import Listing
from weir.jobs.catalog.marker import EXTENSION, Enrichment, enrichment_of
from weir.jobs.catalog.quality import OK, description_quality
from weir.jobs.schemas import BULK_PRIORITY, ClassifyRequest, GenerateRequest, JobRequest
from weir.jobs.catalog.spec import OPTIONAL_COLUMNS, VOTE_METHODS, JobSpec, Taxonomy

NUM_LABEL_HINTS = 6
NUM_TOP_REASONS = 3
"""How many of a field's reason codes ``weir enrich`` prints."""


def classify_header(spec: JobSpec) -> str:
    """The fixed text every classification prompt starts with (one shared, cached prefix)."""
    return spec.classify.header.format(shop=spec.domain.shop) + "\n\n"


def catalog_line(name: str, label: Optional[str] = None) -> str:
    """One product line of a classification prompt; without ``label`` it ends where the label goes."""
    return f"Product: {name}\nCategory:" + ("" if label is None else f" {label}\n\n")


def classify_prompt(spec: JobSpec, name: str, exemplars: Iterable[Labelled] = ()) -> str:
    """The classification prompt of one product: the header, the exemplars' lines with their
    categories, then the product's line that the category completes."""
    shots = "".join(catalog_line(e.name, e.label) for e in exemplars)
    return f"{classify_header(spec)}{shots}{catalog_line(name)}"


def label_text(label: str, hints: list[str]) -> str:
    """What is scored for a label: the category name, its commonest sub-categories, a newline."""
    return f" {label} ({', '.join(hints)})\n" if hints else f" {label}\n"


@dataclass(frozen=True)
class Product:
    """One catalog row, whitespace-stripped. ``category`` is the catalog's own label at the spec's
    taxonomy level ("" when the row has none): the ground truth and, for others, an exemplar."""

    product_id: str
    name: str
    brand: str
    category: str
    description: str


@dataclass(frozen=True)
class Catalog:
    """Products to enrich, the label set and the labelled pool.

    ``labels``: every distinct label of the whole file at the taxonomy's level, sorted (also when
    only the first ``limit`` products are enriched), or the taxonomy file's. ``label_hints`` names
    each label's commonest sub-labels. ``pool``: every labelled row of the whole file (the
    exemplars' source; empty when the labels come from a taxonomy file).
    """

    path: str
    products: list[Product]
    labels: list[str]
    label_hints: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    pool: list[Labelled] = dataclasses.field(default_factory=list)
    spec: JobSpec = JobSpec()
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    """Rows passed over before the last product kept, by reason (``no id ('index' empty)``,
    ``no name ('product' empty)``)."""
    absent_columns: dict[str, str] = dataclasses.field(default_factory=dict)
    """The optional fields (:data:`weir.jobs.catalog.spec.OPTIONAL_COLUMNS`) whose column the spec names but
    the file lacks, each with that column's name (``{"brand": "brand"}``): their products hold ""."""


def label_path(cell: str, taxonomy: Taxonomy) -> list[str]:
    """The label path held by one taxonomy cell: the JSON list's first string when ``json_list``,
    split on ``separator`` when set, parts stripped; ``[]`` for an empty or unreadable cell."""
    cell = cell.strip()
    if taxonomy.json_list:
        try:
            items = json.loads(cell) if cell else []
        except ValueError:
            return []
        cell = items[0].strip() if items and isinstance(items[0], str) else ""
    if not cell:
        return []
    parts = cell.split(taxonomy.separator) if taxonomy.separator else [cell]
    return [part.strip() for part in parts if part.strip()]


DEFAULT_ENCODING = "utf-8"


class MissingColumns(ValueError):
    """The catalog's header lacks columns the spec needs: ``c.csv: no column 'category'; header
    is ['index', 'product']``.

    Attributes:
        path: the catalog file.
        missing: role (as :meth:`weir.jobs.catalog.spec.JobSpec.required_columns` names it) -> the column
            the spec expects.
        header: the file's header row.
    """

    def __init__(self, path: str, missing: dict[str, str], header: list[str]) -> None:
        super().__init__(f"{path}: no column {', '.join(map(repr, missing.values()))}; header is {header}")
        self.path, self.missing, self.header = path, missing, header


class CatalogEncodingError(ValueError):
    """A catalog (or taxonomy) file holds a byte sequence its encoding cannot decode.

    Attributes:
        path: the file.
        line: the 1-based line of the first such byte (the header is line 1); None when the
            decoder did not say where (a UTF-16 file without a byte-order mark).
        offset: that byte's 0-based offset in the file, or None with ``line``.
    """

    def __init__(self, path: str, encoding: str, line: Optional[int], offset: Optional[int], bad: bytes,
                 fix: str, reason: str = "") -> None:
        if line is None:
            super().__init__(f"{path}: not valid {encoding}: {reason}; {fix}")
        else:
            shown = " ".join(f"0x{byte:02x}" for byte in bad)
            super().__init__(f"{path}: line {line}, byte offset {offset}: {shown} is not valid {encoding}; {fix}")
        self.path, self.line, self.offset = path, line, offset


def _encoding_error(path: str, encoding: str, error: UnicodeError, is_catalog: bool = True) -> CatalogEncodingError:
    """Where ``path`` first fails to decode (the file is read again whole, only on this path), and
    how to fix it (only a catalog's encoding can be given). ``error`` is what reading raised; one
    that is not a :class:`UnicodeDecodeError` has no position and is reported as it is."""
    ext = os.path.splitext(path)[1] or ".csv"
    fix = f"convert the file to UTF-8 (iconv -f LATIN1 -t UTF-8 in{ext} > out{ext})"
    if not isinstance(error, UnicodeDecodeError):  # UTF-16 or UTF-32 with no byte-order mark, punycode
        codec = _codec(encoding)
        fix = (f"name its byte order (weir enrich --encoding {codec}-le or {codec}-be)"
               if codec in ("utf-16", "utf-32") else "give the file's own encoding (weir enrich --encoding)")
        reason = str(error).replace("\r", "\\r").replace("\n", "\\n")  # one line
        return CatalogEncodingError(path, encoding, None, None, b"", fix, reason=reason)
    if is_catalog:
        fix = (f"{fix} or give its encoding (weir enrich --encoding latin-1)" if _codec(encoding) == "utf-8-sig"
               else "give the file's own encoding (weir enrich --encoding)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode(_codec(encoding))
    except UnicodeDecodeError as exc:
        offset = len(data) - len(exc.object) + exc.start  # a BOM-skipping codec decodes a suffix
        return CatalogEncodingError(path, encoding, data.count(b"\n", 0, offset) + 1, offset,
                                    exc.object[exc.start:exc.end], fix)
    raise AssertionError(f"{path} decodes as {encoding} when read whole")


def _codec(encoding: str) -> str:
    """The codec a file of ``encoding`` is read with: UTF-8 skips a leading byte-order mark (as
    spreadsheets write one) and is strict otherwise.

    Raises:
        ValueError: Python knows no such encoding, or it is not a text encoding (``rot13``,
            ``base64``, ``hex``, ``zlib``, ``bz2``, ``uu``: codecs from bytes to bytes or str to str).
    """
    try:
        info = codecs.lookup(encoding)
    except LookupError:
        raise ValueError(f"unknown encoding {encoding!r} (a Python codec name: utf-8, latin-1, cp1252, ...)") from None
    if not getattr(info, "_is_text_encoding", True):  # what open() checks before it refuses one
        raise ValueError(f"encoding {encoding!r} is not a text encoding (a Python text codec name: utf-8, latin-1, "
                         "cp1252, ...)")
    name = info.name
    return "utf-8-sig" if name == "utf-8" else name


def read_taxonomy_file(path: str, level: int) -> tuple[list[str], dict[str, list[str]]]:
    """Labels and hints from a taxonomy file of ``id - A > B > C`` lines (Google's product
    taxonomy; ``#`` lines skipped): the distinct paths of depth ``level`` (joined with " > "),
    sorted, each hinted with its first sub-labels in file order.

    Raises:
        OSError: the file cannot be read. CatalogEncodingError: it is not valid UTF-8.
        ValueError: it holds no path of that depth.
    """
    labels: dict[str, list[str]] = {}
    try:
        with open(path, encoding=_codec(DEFAULT_ENCODING)) as f:
            for line in f:
                if line.startswith("#") or " - " not in line:
                    continue
                parts = [p.strip() for p in line.split(" - ", 1)[1].split(" > ")]
                if len(parts) >= level:
                    hints = labels.setdefault(" > ".join(parts[:level]), [])
                    if len(parts) == level + 1 and len(hints) < NUM_LABEL_HINTS:
                        hints.append(parts[level])
    except UnicodeDecodeError as exc:
        raise _encoding_error(path, DEFAULT_ENCODING, exc, is_catalog=False) from None
    if not labels:
        raise ValueError(f"{path}: no taxonomy path of depth {level}")
    return sorted(labels), {label: hints for label, hints in labels.items() if hints}


def read_catalog(path: str, spec: JobSpec = JobSpec(), limit: Optional[int] = None,
                 encoding: str = DEFAULT_ENCODING) -> Catalog:
    """Read a catalog CSV as ``spec`` describes it.

    Args:
        path: CSV file with a header row.
        spec: column names and taxonomy (:class:`weir.jobs.catalog.spec.JobSpec`).
        limit: keep only the first ``limit`` products (rows without an id or a name are skipped).
        encoding: the file's encoding, a Python codec name; UTF-8 (the default) skips a leading
            byte-order mark. Nothing is replaced: a byte the encoding cannot decode is an error.

    Returns:
        The catalog; labels and the exemplar pool are taken from every row of the file.

    The brand and description columns are optional (:data:`weir.jobs.catalog.spec.OPTIONAL_COLUMNS`): one
    the file lacks, or that the spec names as ``""``, leaves that field "" in every product
    (:attr:`Catalog.absent_columns` lists the first kind), and prompts leave it out.

    Raises:
        MissingColumns: a column the spec needs (id, name, the taxonomy's label and hint
            columns) is missing from the header, named in one line with the header.
        ValueError: the file is empty or its first line (the header) blank; the file has no rows below its header and the
            labels come from a column; or there is no label at all (no row has one and the spec names no taxonomy file); ``encoding`` is unknown or
            not a text encoding.
        CatalogEncodingError: a byte the encoding cannot decode; the message names the file, the
            line, the byte offset and how to fix it, e.g. ``c.csv: line 3, byte offset 41: 0xe9 is
            not valid utf-8; convert the file to UTF-8 (...) or give its encoding (weir enrich
            --encoding latin-1)``; the file and the decoder's reason where the decoder gives no
            position (``c.csv: not valid utf-16: UTF-16 stream does not start with BOM; ...``).
        OSError: the file (or the taxonomy file) cannot be read.
    """
    try:
        return _read_catalog(path, spec, limit, encoding)
    except UnicodeError as exc:  # UnicodeDecodeError, or one with no position (no UTF-16 byte-order mark)
        raise _encoding_error(path, encoding, exc) from None


def _read_catalog(path: str, spec: JobSpec, limit: Optional[int], encoding: str) -> Catalog:
    c, t = spec.columns, spec.taxonomy
    from_column = t.source == "column"
    with open(path, newline="", encoding=_codec(encoding)) as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            raise ValueError(f"{path}: the file is empty")
        if not reader.fieldnames:
            raise ValueError(f"{path}: line 1, the header row, is blank")
        header = reader.fieldnames
        roles = spec.required_columns()
        required = list(roles.values())
        missing = {role: name for role, name in roles.items() if name not in header}
        if missing:
            raise MissingColumns(path, missing, list(header))
        optional = {key: getattr(c, key) for key in OPTIONAL_COLUMNS}
        absent = {key: name for key, name in optional.items() if name and name not in header}
        wanted = required + [name for name in optional.values() if name and name in header]
        products: list[Product] = []
        skipped: Counter = Counter()
        pool: list[Labelled] = []
        found: set[str] = set()
        subs: dict[str, Counter] = {}
        num_rows = 0
        for num_rows, row in enumerate(reader, start=1):
            field = {name: (row.get(name) or "").strip() for name in wanted}
            brand, description = field.get(c.brand, ""), field.get(c.description, "")  # optional columns
            label, sub = "", ""
            if from_column:
                parts = label_path(field[t.column], t)
                label = " > ".join(parts[:t.level]) if len(parts) >= t.level else ""
                sub = field[t.hint_column] if t.hint_column else (parts[t.level] if len(parts) > t.level else "")
            if label:
                found.add(label)
            if label and sub:
                subs.setdefault(label, Counter())[sub] += 1
            if not field[c.id] or not field[c.name]:
                if limit is None or len(products) < limit:
                    skipped[f"no id ({c.id!r} empty)" if not field[c.id] else f"no name ({c.name!r} empty)"] += 1
                continue
            if label:
                pool.append(Labelled(field[c.id], field[c.name], brand, label))
            if limit is None or len(products) < limit:
                products.append(Product(field[c.id], field[c.name], brand, label, description))
    if not from_column:
        labels, hints = read_taxonomy_file(t.file, t.level)
        return Catalog(path, products, labels, hints, [], spec, dict(skipped), absent)
    labels = sorted(found)
    if not num_rows:
        raise ValueError(f"{path}: the file has no rows, only a header")
    if not labels:
        raise ValueError(f"{path}: column {t.column!r} holds no label in any row; name a taxonomy "
                         "file in the spec ([taxonomy] source = \"file\")")
    hints = {label: [name for name, _ in counts.most_common(NUM_LABEL_HINTS)] for label, counts in subs.items()}
    return Catalog(path, products, labels, hints, pool, spec, dict(skipped), absent)


def classify_request(product: Product, catalog: Catalog, exemplars: Optional[list[Labelled]] = None,
                     calibrate: Optional[bool] = None, fingerprint: Optional[str] = None) -> ClassifyRequest:
    """The classification job of one product: each label scored as the completion of the
    product's catalog line.

    With ``exemplars`` (the few-shot form), the prompt first shows those products' lines with
    their categories and each label is scored as ``" <label>\n"``, uncalibrated by default. Without
    (zero-shot), each label is followed by its commonest sub-labels and scores are calibrated
    against the same line for ``N/A`` (contextual calibration, Zhao et al. 2021): SmolLM2-135M
    answers chat-style category questions no better than chance.
    """
    spec, labels = catalog.spec, catalog.labels
    shots = exemplars or []
    if calibrate is None:
        calibrate = not shots
    hints = {} if shots else catalog.label_hints
    return ClassifyRequest(
        custom_id=f"{product.product_id}/category",
        prompt=classify_prompt(spec, product.name, shots),
        labels=labels,
        label_texts=[label_text(label, hints.get(label, [])) for label in labels],
        calibration_prompt=classify_prompt(spec, "N/A", shots) if calibrate else None,
        metadata={"product_id": product.product_id},
        extensions={EXTENSION: Enrichment(catalog=catalog_key(catalog), product_id=product.product_id,
                                          fingerprint=fingerprint, product_fields=product_fields(spec),
                                          review_below=spec.classify.review_below or None)},
    )


def listing_of(product: Product) -> Listing:
    """The product's own text, the evidence its description and attributes are checked against
    (:mod:`weir.jobs.catalog.grounding`)."""
    return Listing(name=product.name, brand=product.brand, description=product.description,
                   category=product.category)


def product_fields(spec: JobSpec) -> list[str]:
    """The fields a product's jobs fill under ``spec``: category, description[, attributes]."""
    return ["category", "description"] + (["attributes"] if spec.extract.enabled else [])


def example_values(spec: JobSpec) -> dict[str, list[Any]]:
    """Field -> the distinct non-null values the extraction's worked examples give it."""
    values: dict[str, list[Any]] = {}
    for _, _, answer in spec.extract.worked_examples():
        for name, value in answer.items():
            if value is not None and value not in values.setdefault(name, []):
                values[name].append(value)
    return {name: found for name, found in values.items() if found}


def describe_prompt(spec: JobSpec, product: Product) -> str:
    """The user turn of a description job: the product's title, brand and the first
    ``describe.description_chars`` characters of its source description (whitespace collapsed);
    lines whose field is empty (no brand, no description) are left out."""
    description = " ".join(product.description.split())[:spec.describe.description_chars]
    fields = {"name": product.name, "brand": product.brand, "description": description}
    lines = [line.format(**fields) for line in spec.describe.user_prompt.split("\n")
             if not any(f"{{{k}}}" in line and not v for k, v in fields.items())]
    return "\n".join(lines) or product.name


def describe_request(product: Product, spec: JobSpec, catalog: str, fingerprint: Optional[str] = None) -> GenerateRequest:
    """The description job of one product of ``catalog`` (its :func:`catalog_key`): the spec's
    system prompt and sampling parameters (any ``SamplingParams`` field: stop strings, penalties)."""
    return GenerateRequest(
        custom_id=f"{product.product_id}/description",
        system_prompt=spec.describe.system_prompt.format(shop=spec.domain.shop),
        prompt=describe_prompt(spec, product),
        metadata={"product_id": product.product_id},
        extensions={EXTENSION: Enrichment(catalog=catalog, product_id=product.product_id, fingerprint=fingerprint,
                                          retry_sampling=spec.describe.retry_sampling or None,
                                          listing=listing_of(product), product_fields=product_fields(spec))},
        **spec.describe.sampling,
    )


def extract_request(product: Product, spec: JobSpec, catalog: str, fingerprint: Optional[str] = None) -> GenerateRequest:
    """The attribute extraction job of one product of ``catalog`` (its :func:`catalog_key`): chat
    messages (:func:`weir.jobs.catalog.extraction.extraction_messages`) and the spec's ``[extract]``
    sampling, the output constrained to ``spec.extract.schema`` (``structured_outputs.json``, no
    whitespace between tokens: it costs tokens and says nothing), its parsed value filling the
    row's ``attributes``."""
    extract = spec.extract
    return GenerateRequest(
        custom_id=f"{product.product_id}/attributes",
        prompt=extraction_messages(extract, spec.domain.shop, product.name, product.description),
        metadata={"product_id": product.product_id},
        extensions={EXTENSION: Enrichment(catalog=catalog, product_id=product.product_id, field="attributes",
                                          fingerprint=fingerprint, listing=listing_of(product),
                                          example_values=example_values(spec) or None,
                                          field_evidence=extract.evidence or None,
                                          product_fields=product_fields(spec))},
        structured_outputs={"json": extract.schema, "disable_any_whitespace": True},
        **extract.sampling,
    )


def product_requests(product: Product, catalog: Catalog, index: Optional[ExemplarIndex] = None,
                     fingerprint: Optional[str] = None, voted: bool = False) -> list[JobRequest]:
    """The jobs of one product: classify it into the catalog's labels (unless ``voted``: the
    nearest-neighbour vote decided its category, :func:`category_votes`), describe it, and (when the
    spec names ``[extract.fields]``) extract its attributes.

    With ``index`` (and the spec's ``method`` ``exemplars`` or ``hybrid``), the classification prompt shows the
    product's ``num_exemplars`` nearest labelled products (never itself nor a row with its title).

    ``custom_id`` is ``<product_id>/category``, ``<product_id>/description`` and
    ``<product_id>/attributes``; each carries ``metadata["product_id"]`` and is marked as enrichment
    of (:func:`catalog_key`, product id), so the worker fills that product's row of that catalog,
    with ``fingerprint`` (:func:`product_fingerprint`) beside each field it fills.
    """
    spec = catalog.spec
    key = catalog_key(catalog)
    requests: list[JobRequest] = []
    if not voted:
        shots = None
        if index is not None and spec.classify.method in ("exemplars", "hybrid"):
            shots = index.nearest(product.product_id, product.name, product.brand, spec.classify.num_exemplars)
        requests.append(classify_request(product, catalog, shots, fingerprint=fingerprint))
    requests.append(describe_request(product, spec, key, fingerprint))
    if spec.extract.enabled:
        requests.append(extract_request(product, spec, key, fingerprint))
    return requests


def catalog_key(catalog: Catalog) -> str:
    """The ``product_enrichment.catalog`` of a catalog's rows: its file's absolute path."""
    return os.path.abspath(catalog.path)


def exemplar_index(catalog: Catalog) -> Optional[ExemplarIndex]:
    """The catalog's exemplar index, or None when the spec asks for zero-shot or nothing is labelled."""
    if catalog.spec.classify.method == "zero_shot" or not catalog.pool:
        return None
    return ExemplarIndex(catalog.pool)


@dataclass(frozen=True)
class Vote:
    """A category the nearest-neighbour vote decided, no model: ``label`` (None when no labelled
    product could vote) and its ``share`` of the vote (0 to 1: the label's summed similarity over
    all the voters')."""

    product_id: str
    label: Optional[str]
    share: float


def category_votes(catalog: Catalog, products: Iterable[Product],
                   index: Optional[ExemplarIndex] = None) -> dict[str, Vote]:
    """Product id -> :class:`Vote`, for the ``products`` whose category the spec's ``[classify]``
    method leaves to the vote of their ``num_neighbours`` nearest labelled products
    (:meth:`weir.jobs.catalog.exemplars.ExemplarIndex.vote`; a tie goes to the label first
    reached): every product with ``knn``, those whose share is at least ``vote_threshold`` with
    ``hybrid``, none with the model's methods. Measured against the model: BENCHMARKS.md,
    "Categories: kNN, LLM, hybrid".

    Raises:
        ValueError: a vote method with no labelled product in the catalog.
    """
    c = catalog.spec.classify
    if c.method not in VOTE_METHODS:
        return {}
    if index is None:
        if not catalog.pool:
            raise ValueError(f"{catalog.path}: [classify] method = {c.method!r} needs labelled products; none "
                             f"has a {catalog.spec.taxonomy.column!r}")
        index = ExemplarIndex(catalog.pool)
    votes = {}
    for product in products:
        counts = index.vote(product.product_id, product.name, product.brand, c.num_neighbours)
        total = sum(counts.values())
        label = max(counts, key=counts.get) if counts and total > 0 else None
        vote = Vote(product.product_id, label, counts[label] / total if label is not None else 0.0)
        if c.method == "knn" or (label is not None and vote.share >= c.vote_threshold):
            votes[product.product_id] = vote
    return votes


def vote_review_below(spec: JobSpec) -> Optional[float]:
    """The vote share below which a voted category is ``review``: ``vote_threshold`` under ``knn``;
    None under ``hybrid``, whose voted categories all reach it."""
    return spec.classify.vote_threshold if spec.classify.method == "knn" else None


def catalog_requests(catalog: Catalog, plan: Optional["EnrichmentPlan"] = None,
                     votes: Optional[dict[str, Vote]] = None,
                     index: Optional[ExemplarIndex] = None) -> list[JobRequest]:
    """The requests (:func:`product_requests`) of every product, or of ``plan``'s products to
    enrich with their fingerprints, product by product; no classification job for the products
    ``votes`` decided (None: :func:`category_votes` of those products). ``index``: the catalog's
    :func:`exemplar_index` when the caller has it (None: built here)."""
    if index is None:
        index = exemplar_index(catalog)
    products = catalog.products if plan is None else plan.todo
    if votes is None:
        votes = category_votes(catalog, products, index)
    return [r for product in products
            for r in product_requests(product, catalog, index,
                                      None if plan is None else plan.fingerprints[product.product_id],
                                      voted=product.product_id in votes)]


def spec_version(spec: JobSpec) -> str:
    """A hash of everything in ``spec`` that shapes the jobs' outputs, hex: its file's path and
    what only the decisions read (``[classify] review_below``, ``[extract.evidence]``, and
    ``vote_threshold`` with ``knn``) left out, so that changing those re-enriches nothing (rows keep
    the decision made when they were stored); the vote's keys are left out too with the model's
    methods, which do not read them."""
    fields = spec.model_copy(update={"path": None}).model_dump()
    classify = fields["classify"]
    classify.pop("review_below")
    fields["extract"].pop("evidence")
    if classify["method"] not in VOTE_METHODS:
        classify.pop("num_neighbours")
    if classify["method"] != "hybrid":
        classify.pop("vote_threshold")
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def product_fingerprint(product: Product, spec: JobSpec, model: str, version: Optional[str] = None) -> str:
    """What a product's enrichment is made from: a hash (64 hex digits) of its content (every
    :class:`Product` field), :func:`spec_version` of the job spec (``version``, when the caller
    has it already) and the model's name."""
    content = [dataclasses.astuple(product), version or spec_version(spec), model]
    return hashlib.sha256(json.dumps(content, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class EnrichmentPlan:
    """Which products an incremental run enriches (``todo``, in catalog order)
    and why. ``new``: no fingerprint stored for it; ``changed``: a field was made from other
    content, spec or model; ``unfinished``: no field was, but one is missing (a failed job, one
    a stopped run never ran); ``unchanged``: every field the spec fills carries the product's
    current fingerprint (skipped, unless ``full``)."""

    todo: list[Product]
    fingerprints: dict[str, str]
    num_new: int
    num_changed: int
    num_unchanged: int
    full: bool = False
    num_unfinished: int = 0


def plan_enrichment(session_factory: Any, catalog: Catalog, model: str, *, full: bool = False) -> EnrichmentPlan:
    """Compare each product's :func:`product_fingerprint` with those stored beside its fields in
    ``product_enrichment`` (one query for the catalog) and plan the run.

    Args:
        session_factory: the results database's (``Client.session_factory``).
        model: the name the workers' model is known by (``Client.model``).
        full: enrich every product whatever is stored (``weir enrich --full``).
    """
    from weir.jobs.catalog.store import enrichment_fingerprints

    with session_factory() as session:
        stored = enrichment_fingerprints(session, catalog_key(catalog))
    wanted = 3 if catalog.spec.extract.enabled else 2  # category, description[, attributes]
    todo, fingerprints = [], {}
    num_new = num_changed = num_unfinished = 0
    version = spec_version(catalog.spec)
    for product in catalog.products:
        fingerprint = fingerprints[product.product_id] = product_fingerprint(product, catalog.spec, model, version)
        have = stored.get(product.product_id)
        if have is None or not any(have):
            num_new += 1
        elif any(fp is not None and fp != fingerprint for fp in have[:wanted]):
            num_changed += 1
        elif any(fp is None for fp in have[:wanted]):
            num_unfinished += 1
        elif not full:
            continue
        todo.append(product)
    num_unchanged = len(catalog.products) - num_new - num_changed - num_unfinished
    return EnrichmentPlan(todo, fingerprints, num_new, num_changed, num_unchanged, full, num_unfinished)


def enqueue_catalog(client: Any, catalog: Catalog, *, idempotency_key: Optional[str] = None,
                    priority: int = BULK_PRIORITY, plan: Optional[EnrichmentPlan] = None,
                    votes: Optional[dict[str, Vote]] = None) -> Any:
    """Enqueue one enrichment batch for ``catalog`` through a :class:`weir.jobs.client.Client`,
    then store the categories the nearest-neighbour vote decided (the spec's ``[classify]``
    method ``knn`` or ``hybrid``) in ``product_enrichment`` as that batch's
    (:func:`weir.jobs.catalog.store.record_votes`): those products get no classification job.

    Args:
        idempotency_key: when a batch with this key exists, nothing is enqueued and its id is
            returned (the nightly run's catalog and slot); the votes are stored again, the same.
        priority: the batch's priority (``Client.enqueue_batch``'s); bulk by default, so that
            jobs enqueued one by one run first.
        plan: enqueue only its products, with their fingerprints (:func:`plan_enrichment`);
            None: every product, without fingerprints.
        votes: the votes of the products enqueued (:func:`category_votes`; None: computed here).

    Returns:
        The batch id, or None when ``plan`` has nothing to enrich (nothing is enqueued).

    Raises:
        ValueError: two products share an id (their custom_ids collide); nothing was stored.
    """
    products = catalog.products if plan is None else plan.todo
    index = exemplar_index(catalog)  # one TF-IDF fit for the votes and the exemplars
    if votes is None:
        votes = category_votes(catalog, products, index)
    requests = catalog_requests(catalog, plan, votes, index)
    if not requests:
        return None
    key = catalog_key(catalog)
    batch_id = client.enqueue_batch(
        requests,
        metadata={
            "kind": "catalog_enrichment",
            "catalog": key,
            "num_products": len(products),
            "labels": catalog.labels,
            "num_categories_voted": len(votes),
        },
        idempotency_key=idempotency_key,
        priority=priority,
    )
    if votes:
        from weir.jobs.catalog.store import record_votes

        with client.session_factory.begin() as session:
            record_votes(session, key, list(votes.values()), batch_id, model=client.model,
                         review_below=vote_review_below(catalog.spec),
                         fingerprints=None if plan is None else plan.fingerprints,
                         product_fields=product_fields(catalog.spec))
    return batch_id


@dataclass(frozen=True)
class EnrichmentSummary:
    """What one enrichment batch achieved.

    Rates are None when their denominator is zero. ``prefix_cache_hit_rate`` is cached prompt
    tokens over prompt tokens, summed over the batch's finished jobs.
    """

    num_products: int
    num_succeeded: int
    num_failed: int
    wall_s: float
    """The whole command's time: reading, loading the model, the batch, this summary."""
    num_generated_tokens: int
    generated_tokens_per_s: Optional[float]
    prefix_cache_hit_rate: Optional[float]
    num_classified: int
    accuracy: Optional[float]
    majority_label: Optional[str]
    majority_baseline: Optional[float]
    num_described: int = 0
    description_quality: dict[str, int] = dataclasses.field(default_factory=dict)
    num_extracted: int = 0
    num_attributes_valid: int = 0
    num_attributes_cut: int = 0
    plan: Optional["EnrichmentPlan"] = None
    num_failed_products: int = 0
    num_cancelled: int = 0
    neighbour_vote_accuracy: Optional[float] = None
    """Accuracy of the nearest-neighbour vote with no model (:meth:`weir.jobs.catalog.exemplars.ExemplarIndex.vote`)
    on the same products; None without a labelled pool."""
    how_chosen: str = ""
    """How the model chose categories, one line (:func:`how_categories_are_chosen`)."""
    batch_s: Optional[float] = None
    """From enqueue to the batch's end (the rate's denominator); None: ``wall_s``."""
    decisions: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """Field -> decision (``auto``, ``review``, ``reject``) -> how many of the batch's succeeded jobs
    filling that field got it (:func:`weir.jobs.catalog.decisions.judge`)."""
    reasons: dict[str, list[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    """Field -> its reason codes, commonest first, each with how many of the field's rows carry it
    (a code a row gives twice counts once)."""
    num_publishable: int = 0
    """Products every field of which (those their spec asks for) is ``auto``."""

    @property
    def clean_rate(self) -> Optional[float]:
        """Share of succeeded descriptions whose quality is ``ok``."""
        return self.description_quality.get(OK, 0) / self.num_described if self.num_described else None

    def format(self) -> str:
        def pct(x: Optional[float]) -> str:
            return "n/a" if x is None else f"{100 * x:.1f} %"

        rate = "n/a" if self.generated_tokens_per_s is None else f"{self.generated_tokens_per_s:.1f}"
        products = f"{self.num_products}"
        if self.plan is not None:
            products = (f"{len(self.plan.todo)} enriched of {self.num_products} ({self.plan.num_new} new, "
                        f"{self.plan.num_changed} changed, {self.plan.num_unfinished} unfinished, "
                        f"{self.plan.num_unchanged} unchanged"
                        f"{' but redone (--full)' if self.plan.full else ' skipped'}, "
                        f"{self.num_failed_products} failed)")
        return "\n".join(
            [
                f"products:            {products}",
                f"jobs:                {self.num_succeeded} succeeded, {self.num_failed} failed"
                + (f", {self.num_cancelled} cancelled" if self.num_cancelled else ""),
                f"wall time:           {self.wall_s:.1f} s"
                + (f" (the batch {self.batch_s:.1f} s)" if self.batch_s is not None else ""),
                f"generated tokens:    {self.num_generated_tokens} ({rate} tokens/s)",
                f"prefix-cache hits:   {pct(self.prefix_cache_hit_rate)} of prompt tokens",
                f"category accuracy:   {pct(self.accuracy)} over {self.num_classified} products "
                f"(majority baseline {pct(self.majority_baseline)}: {self.majority_label}; "
                f"nearest-neighbour vote, no model: {pct(self.neighbour_vote_accuracy)})",
            ] + ([f"categories chosen:   {self.how_chosen}"] if self.how_chosen else []) + [
                f"descriptions clean:  {pct(self.clean_rate)} of {self.num_described} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(self.description_quality.items())) or 'none'})",
            ] + ([f"attributes:          {self.num_attributes_valid} of {self.num_extracted} extracted valid "
                  f"({self.num_attributes_cut} cut by max_tokens)"] if self.num_extracted else [])
            + self._decision_lines()
        )

    def _decision_lines(self) -> list[str]:
        """``decisions <field>: 3 auto, 1 review, 0 reject; top reasons: unsupported_number 1`` per
        field, then the publishable products."""
        if not self.decisions:
            return []
        lines = []
        for name in ("category", "description", "attributes"):
            counts = self.decisions.get(name)
            if counts is None:
                continue
            top = ", ".join(f"{code} {n}" for code, n in self.reasons.get(name, [])[:NUM_TOP_REASONS])
            lines.append(f"{name + ':':<21}{counts.get('auto', 0)} auto, {counts.get('review', 0)} review, "
                         f"{counts.get('reject', 0)} reject" + (f"; top reasons: {top}" if top else ""))
        num_products = len(self.plan.todo) if self.plan is not None else self.num_products
        return lines + [f"publishable:         {self.num_publishable} of {num_products} products (every field auto)"]


def how_categories_are_chosen(spec: JobSpec) -> str:
    """One line saying how ``spec`` chooses a category."""
    c = spec.classify
    k = c.num_exemplars
    model = (f"the model scores each label after a prompt that shows the product's {k} nearest labelled "
             f"products of the same catalog (TF-IDF of name and brand) with their categories")
    vote = f"the vote of the product's {c.num_neighbours} nearest labelled products (TF-IDF of name and brand)"
    if c.method == "knn":
        return f"{vote}, no model; review below a vote share of {c.vote_threshold:g}"
    if c.method == "hybrid":
        return f"{vote} where its share is at least {c.vote_threshold:g}; elsewhere {model}"
    if c.method == "exemplars":
        return model
    return "the model scores each label, with its commonest sub-labels, calibrated against \"N/A\"; no examples"


def neighbour_vote_accuracy(catalog: Catalog, products: list[Product]) -> Optional[float]:
    """Share of ``products`` whose category the nearest-neighbour vote alone gets right: the
    ``knn`` method's vote (:func:`category_votes`) of the spec's ``num_neighbours`` nearest labelled
    products under a vote method, else of its ``num_exemplars`` (those a prompt shows); a product
    no labelled product is similar to gets no category. None when ``products`` is empty or the
    catalog has no labelled pool."""
    if not products or not catalog.pool:
        return None
    c = catalog.spec.classify
    k = c.num_neighbours if c.method in VOTE_METHODS else c.num_exemplars
    knn = dataclasses.replace(catalog, spec=catalog.spec.model_copy(update={"classify": c.model_copy(
        update={"method": "knn", "num_neighbours": k})}))
    votes = category_votes(knn, products)
    return sum(votes[p.product_id].label == p.category for p in products) / len(products)


def summarize(catalog: Catalog, results: Iterable[dict[str, Any]], wall_s: float,
              plan: Optional[EnrichmentPlan] = None, batch_s: Optional[float] = None,
              votes: Optional[dict[str, Vote]] = None) -> EnrichmentSummary:
    """Summarize a finished enrichment batch.

    Args:
        catalog: the catalog the batch was built from (its categories are the ground truth).
        results: the batch's rows as :meth:`weir.jobs.client.Client.results` returns them.
        wall_s: seconds the command took (its start to this summary).
        batch_s: seconds from enqueue to the batch's end, the generation rate's denominator (None:
            ``wall_s``).
        plan: the incremental run's plan (new, changed, unchanged products), when there was one.
        votes: the categories the vote decided for the batch (:func:`category_votes`): they count
            as classified products, with their decisions, beside the classification jobs.

    ``num_failed_products`` counts the products with a job that did not succeed.
    Accuracy counts succeeded classification jobs of products that have a catalog category (at
    the spec's taxonomy level) whose label equals it; the majority baseline is the share of the
    most common category among those products, the nearest-neighbour vote's accuracy
    (:func:`neighbour_vote_accuracy`) is over the same products. Description quality counts each succeeded
    description's :func:`weir.jobs.catalog.quality.description_quality`. Of the succeeded attribute
    extractions, ``num_attributes_valid`` have a parsed value (finished, so valid against the
    schema) and ``num_attributes_cut`` were cut by ``max_tokens``.
    """
    results = list(results)
    truth = {p.product_id: p.category for p in catalog.products}
    by_id = {p.product_id: p for p in catalog.products}
    num_generated = sum(r["num_completion_tokens"] or 0 for r in results if r["kind"] == "generate")
    num_prompt = sum(r["num_prompt_tokens"] or 0 for r in results)
    num_cached = sum(r["num_cached_tokens"] or 0 for r in results)
    classified = [
        r for r in results if r["kind"] == "classify" and r["status"] == "succeeded"
        and truth.get(str(r["metadata"].get("product_id")))
    ]
    generated = [r for r in results if r["kind"] == "generate" and r["status"] == "succeeded"]
    fills = [getattr(enrichment_of(r), "field", None) for r in generated]
    extracted = [r for r, field in zip(generated, fills) if field == "attributes"]
    described = [r for r, field in zip(generated, fills) if field != "attributes"]
    voted = [v for v in (votes or {}).values() if truth.get(v.product_id)]
    chosen = [(str(r["metadata"].get("product_id")), r["label"]) for r in classified] + [
        (v.product_id, v.label) for v in voted]
    categories = [truth[product_id] for product_id, _ in chosen]
    num_correct = sum(label == category for (_, label), category in zip(chosen, categories))
    majority = Counter(categories).most_common(1)
    rate_s = wall_s if batch_s is None else batch_s
    review_below = vote_review_below(catalog.spec)
    decisions, reasons, num_publishable = _decision_counts(results, {
        product_id: judge_category(v.label, v.share, review_below) for product_id, v in (votes or {}).items()})
    return EnrichmentSummary(
        num_products=len(catalog.products),
        num_succeeded=sum(r["status"] == "succeeded" for r in results),
        num_failed=sum(r["status"] == "failed" for r in results),
        num_cancelled=sum(r["status"] == "cancelled" for r in results),
        wall_s=wall_s,
        batch_s=batch_s,
        num_generated_tokens=num_generated,
        generated_tokens_per_s=num_generated / rate_s if rate_s > 0 else None,
        prefix_cache_hit_rate=num_cached / num_prompt if num_prompt else None,
        num_classified=len(chosen),
        accuracy=num_correct / len(chosen) if chosen else None,
        majority_label=majority[0][0] if majority else None,
        majority_baseline=majority[0][1] / len(chosen) if majority else None,
        num_described=len(described),
        description_quality=dict(Counter(description_quality(r["output_text"]) for r in described)),
        num_extracted=len(extracted),
        num_attributes_valid=sum(r["parsed"] is not None for r in extracted),
        num_attributes_cut=sum(r["finish_reason"] == "length" for r in extracted),
        plan=plan,
        neighbour_vote_accuracy=neighbour_vote_accuracy(catalog, [by_id[product_id] for product_id, _ in chosen]),
        how_chosen=how_categories_are_chosen(catalog.spec),
        num_failed_products=len({str(r["metadata"].get("product_id")) for r in results if r["status"] != "succeeded"}),
        decisions=decisions,
        reasons=reasons,
        num_publishable=num_publishable,
    )


def _decision_counts(results: list[dict[str, Any]], voted: dict[str, Any]) -> tuple[
        dict[str, dict[str, int]], dict[str, list[tuple[str, int]]], int]:
    """Per field, the decisions of the succeeded enrichment jobs among ``results`` (rows of
    :meth:`weir.jobs.client.Client.results`, each with the catalog's annotation) and of the voted
    categories (``voted``: product id -> its :class:`weir.jobs.catalog.decisions.Decision`), and
    their reason codes (commonest first); and how many products have every wanted field ``auto``
    (the fields their marks name, else those seen)."""
    decisions: dict[str, Counter] = {}
    reasons: dict[str, Counter] = {}
    by_product: dict[str, dict[str, str]] = {}
    wanted: dict[str, set[str]] = {}

    def count(product_id: str, field: str, decision: str, codes: Iterable[str]) -> None:
        decisions.setdefault(field, Counter())[decision] += 1
        reasons.setdefault(field, Counter()).update(list(dict.fromkeys(codes)))  # rows per code, not occurrences
        by_product.setdefault(product_id, {})[field] = decision

    for r in results:
        mark = enrichment_of(r)
        if mark is None:
            continue
        product_id = mark.product_id
        wanted.setdefault(product_id, set()).update(mark.product_fields or [])
        if r["status"] != "succeeded":
            continue
        decision = r["annotations"][EXTENSION]  # the catalog's annotation: decisions.annotate_result
        count(product_id, decision["field"], decision["decision"], (reason["code"] for reason in decision["reasons"]))
    for product_id, decision in voted.items():
        count(product_id, decision.field, decision.decision, (reason["code"] for reason in decision.reasons))
    num_publishable = sum(
        all(fields.get(name) == AUTO for name in (wanted.get(product_id) or fields))
        for product_id, fields in by_product.items())
    return ({name: dict(counts) for name, counts in decisions.items()},
            {name: counts.most_common() for name, counts in reasons.items()}, num_publishable)
