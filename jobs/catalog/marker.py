"""The catalog's mark on a job: :class:`Enrichment`, kept under ``request.extensions["enrichment"]``
(the ``weir.request_extensions`` entry point ``enrichment``). The queue core stores it with the
request and checks it through :meth:`Enrichment.check_request`; the catalog's result projection
(:mod:`weir.jobs.catalog.store`) and post-run policy (:mod:`weir.jobs.catalog.quality`) read it back
with :func:`enrichment_of`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from weir.jobs.catalog.grounding import EvidenceKind, Listing

EXTENSION = "enrichment"
"""The name the catalog's data has in a request's ``extensions``."""

MAX_PRODUCT_ID_CHARS = 64  # product_enrichment.product_id is VARCHAR(64)
MAX_CATALOG_CHARS = 300  # product_enrichment.catalog is VARCHAR(300)


class Enrichment(BaseModel):
    """Marks a catalog enrichment job: its result fills the ``product_enrichment`` row of
    (``catalog``, ``product_id``). ``field`` says which of the row's fields: ``category`` (a
    classification's label and its probability), ``description`` (a generation's text and its
    ``quality``) or ``attributes`` (a generation constrained to JSON: its parsed value). When not
    given it is ``category`` for a classification and ``description`` for a generation. Jobs
    without it never write that table, whatever their metadata holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    catalog: str = Field(min_length=1, max_length=MAX_CATALOG_CHARS)
    product_id: str = Field(min_length=1, max_length=MAX_PRODUCT_ID_CHARS)
    field: Optional[Literal["category", "description", "attributes"]] = None
    fingerprint: Optional[str] = Field(None, min_length=1, max_length=64)
    """What the result was made from (the catalog job's :func:`weir.jobs.catalog.product_fingerprint`
    of the product's content, the job spec and the model), stored beside the field it fills so that
    an incremental run skips the products it has already enriched."""
    retry_sampling: Optional[dict[str, Any]] = None
    """A description job only: when its output is flagged
    (:func:`weir.jobs.catalog.quality.description_quality` not ``ok``), the worker generates it once more
    with these sampling fields replaced and keeps the first clean attempt (else the first); the
    job's token counts include both attempts."""

    listing: Optional[Listing] = None
    """The product's own text (title, brand, source description, the catalog's category), the
    evidence a description or an extraction is checked against
    (:mod:`weir.jobs.catalog.decisions`); without it such a field is never ``auto``."""
    example_values: Optional[dict[str, list[Any]]] = None
    """An extraction only: field -> the values the prompt's worked examples give it; a value copied
    from them that the listing does not hold is never ``auto``."""
    field_evidence: Optional[dict[str, EvidenceKind]] = None
    """An extraction only: field -> what shows its value right (the spec's ``[extract.evidence]``;
    :func:`weir.jobs.catalog.decisions.judge_attributes`); a field not named: ``listing``."""
    review_below: Optional[float] = Field(None, ge=0.0, le=1.0)
    """A classification only: its category is ``review`` (``low_confidence``) when the label's
    probability is below this (the spec's ``[classify] review_below``)."""
    product_fields: Optional[list[Literal["category", "description", "attributes"]]] = None
    """The fields the product's jobs fill (the spec's): its row is publishable only when each of
    them is ``auto``. None: not said (the row keeps what it holds)."""

    def check_request(self, request: Any) -> None:
        """Refuse a mark that does not fit its job (``request``: a ``ClassifyRequest`` or
        ``GenerateRequest``).

        Raises:
            ValueError: a classification that fills another field than ``category``; a generation
                that fills ``category``, fills ``attributes`` without being constrained to JSON, or
                asks ``retry_sampling`` of another field than ``description``, of
                ``structured_outputs``, or of values the engine's ``SamplingParams`` refuses. The
                message names the field (``field``, ``retry_sampling``).
        """
        if request.kind == "classify":
            for name in ("example_values", "field_evidence"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only an extraction carries them")
            if self.field not in (None, "category"):
                raise ValueError(f"field: a classification job fills category, not {self.field}")
            return
        if self.field == "category":
            raise ValueError("field: a generation job fills description or attributes, not category")
        if self.review_below is not None:
            raise ValueError("review_below: only a classification carries it")
        if self.retry_sampling is not None:
            if self.field not in (None, "description"):
                raise ValueError("retry_sampling: only a description job is retried")
            if "structured_outputs" in self.retry_sampling:
                raise ValueError("retry_sampling: structured_outputs cannot be replaced")
            try:
                request.params_with(self.retry_sampling)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"retry_sampling: {exc}") from None
        for name in ("example_values", "field_evidence"):
            if getattr(self, name) is not None and self.field != "attributes":
                raise ValueError(f"{name}: only an extraction carries them")
        if self.field == "attributes" and not request.wants_json:
            raise ValueError("field: attributes are filled only by a job constrained to JSON "
                             "(response_format json_schema or json_object)")

    def sampling_attempts(self) -> dict[str, dict[str, Any]]:
        """``{"retry_sampling": ...}`` when the job may run a second time, else nothing."""
        return {"retry_sampling": self.retry_sampling} if self.retry_sampling else {}


def enrichment_of(request: Any) -> Optional[Enrichment]:
    """The catalog's mark on a job, or None: ``request`` is a parsed request (its ``extensions``)
    or a stored one (a dict, ``jobs.request``)."""
    extensions = request.get("extensions") if isinstance(request, dict) else request.extensions
    value = (extensions or {}).get(EXTENSION)
    return None if value is None else Enrichment.model_validate(value)
