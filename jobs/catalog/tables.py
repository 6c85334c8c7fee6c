"""The catalog application's table: ``product_enrichment``, one row per product of a catalog, on the
queue core's declarative base (:class:`weir.jobs.db.Base`), so that its migrations and the core's
are one Alembic history. Its downstream view ``latest_enrichment`` is created by the migrations
(docs/downstream.md)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Optional

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from weir.jobs.db import Base, utcnow


class ProductEnrichment(Base):
    """What the model said about one product of one catalog, keyed by (``catalog``,
    ``product_id``): two catalogs' products of the same id keep their own rows. Written only by
    jobs marked as catalog enrichment (:class:`weir.jobs.catalog.marker.Enrichment`). A field is written only
    by a batch created no earlier than the one that last wrote the row (``source_batch_created_at``):
    a late result of an older batch never overwrites a newer one."""

    __tablename__ = "product_enrichment"
    __table_args__ = (
        # Downstream reads (``latest_enrichment``, docs/downstream.md): rows changed since a
        # time, and the rows a batch wrote.
        Index("ix_product_enrichment_updated_at", "updated_at"),
        Index("ix_product_enrichment_source_batch_id", "source_batch_id"),
    )

    catalog: Mapped[str] = mapped_column(String(300), primary_key=True)
    product_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    category: Mapped[Optional[str]] = mapped_column(Text)
    category_confidence: Mapped[Optional[float]] = mapped_column(Float)
    category_method: Mapped[Optional[str]] = mapped_column(String(16))
    """How the category was chosen: ``llm`` (a classification job; ``category_confidence`` is the
    label's probability) or ``knn`` (the nearest-neighbour vote, no model; ``category_confidence`` is
    the label's share of the vote); null in rows written before it was recorded."""
    description: Mapped[Optional[str]] = mapped_column(Text)
    quality: Mapped[Optional[str]] = mapped_column(String(32))
    """The description's check (:func:`weir.jobs.catalog.quality.description_quality`): ``ok``, or its
    flags; never publish a description whose quality is not ``ok`` unread."""
    category_fingerprint: Mapped[Optional[str]] = mapped_column(String(64))
    description_fingerprint: Mapped[Optional[str]] = mapped_column(String(64))
    attributes_fingerprint: Mapped[Optional[str]] = mapped_column(String(64))
    """Each field's source: the :func:`weir.jobs.catalog.product_fingerprint` (product content, job
    spec, model) of the job that wrote it; an incremental ``weir enrich`` skips a product whose
    fields all carry its current fingerprint."""
    attributes: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON(none_as_null=True))
    """The attribute extraction's answer (the job spec's ``[extract]`` schema: every field, null
    where the listing does not say), valid against that schema; null when the extraction did not
    finish (cut by ``max_tokens``: its job's ``finish_reason`` is ``length``)."""
    category_decision: Mapped[Optional[str]] = mapped_column(String(16))
    category_reasons: Mapped[Optional[list[Any]]] = mapped_column(JSON(none_as_null=True))
    description_decision: Mapped[Optional[str]] = mapped_column(String(16))
    description_reasons: Mapped[Optional[list[Any]]] = mapped_column(JSON(none_as_null=True))
    attributes_decision: Mapped[Optional[str]] = mapped_column(String(16))
    attributes_reasons: Mapped[Optional[list[Any]]] = mapped_column(JSON(none_as_null=True))
    """Each field's decision (:mod:`weir.jobs.catalog.decisions`): ``auto``, ``review`` or
    ``reject``, and its reasons (``[{"code": ..., "text": ...}]``), written with the field; null
    until the field is written by a job of this revision or later."""
    attributes_confidence: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON(none_as_null=True))
    """Attribute -> the probability the model gave its value's tokens
    (:func:`weir.jobs.catalog.decisions.attribute_confidence`); null when the extraction asked for
    no log-probabilities."""
    attributes_wanted: Mapped[Optional[bool]] = mapped_column(Boolean)
    """Whether the product's job spec asks for attributes (then they must be ``auto`` too for the
    row to be publishable); null when no job said."""
    model: Mapped[str] = mapped_column(String(200))
    source_batch_id: Mapped[Optional[uuid.UUID]] = mapped_column(
        ForeignKey("batches.id", ondelete="SET NULL")
    )
    source_batch_created_at: Mapped[Optional[datetime]]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
