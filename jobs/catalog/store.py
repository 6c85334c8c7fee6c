"""The catalog's table: ``product_enrichment`` rows written from stored results (the result
projection the group commit calls, :data:`weir.jobs.applications.RESULT_PROJECTIONS`) and read
back for the incremental plan."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Optional, Sequence

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from weir.jobs.catalog.decisions import attribute_confidence, judge, judge_category
from weir.jobs.catalog.marker import enrichment_of
from weir.jobs.catalog.quality import description_quality
from weir.jobs.catalog.tables import ProductEnrichment
from weir.jobs.db import Batch, Job, JobKind, JobStatus, utcnow
from weir.jobs.results import JobResult, uuid_literal


def project_results(session: Session, results: Sequence[tuple[Job, JobResult]], *, model: str) -> None:
    """The catalog's result projection (:class:`weir.jobs.applications.ResultProjection`): the
    enrichment rows of ``results`` (:func:`record_enrichments`)."""
    record_enrichments(session, results, model=model)


def record_enrichment(session: Session, job: Job, result: JobResult, *, model: str) -> bool:
    """:func:`record_enrichments` for one job; True when it wrote the row."""
    return bool(record_enrichments(session, [(job, result)], model=model))


def enrichment_target(job: Job) -> Optional[tuple[str, str]]:
    """(catalog, product id) of a job marked as catalog enrichment (its request's
    ``extensions["enrichment"]``, :func:`~weir.jobs.catalog.marker.enrichment_of`), else None: a
    job's metadata never makes it one."""
    target = enrichment_of(job.request)
    return None if target is None else (target.catalog, target.product_id)


def record_enrichments(session: Session, results: Sequence[tuple[Job, JobResult]], *,
                       model: str) -> set[tuple[str, str]]:
    """Upsert the ``product_enrichment`` rows of succeeded catalog enrichment jobs, keyed by
    (catalog, product id) (see :func:`enrichment_target`).

    A classification job sets ``category`` and ``category_confidence`` (the label's probability);
    a generation job sets ``description`` and its ``quality``
    (:func:`weir.jobs.catalog.quality.description_quality`), or, marked ``field="attributes"``, sets
    ``attributes`` to its parsed JSON (null when it did not finish). Each sets its field's decision
    and reasons (:mod:`weir.jobs.catalog.decisions`) and, when its mark names the product's fields,
    ``attributes_wanted``. Fields the job does not produce are left as they are.
    A row is written only when the job's batch was created no earlier than the batch that last
    wrote it (``source_batch_created_at``): an older batch's late result never overwrites a newer
    one. Call it in the transaction that stored the results, with only the jobs whose row took
    them (see :func:`record_results`), so a redelivered job never writes twice.

    Args:
        results: (job, result) pairs; jobs not marked as enrichment and results that did not
            succeed are skipped.
        model: name of the model that produced them.

    Returns:
        The (catalog, product id) keys whose row was written.
    """
    wanted = [(job, result.storable()) for job, result in results
              if result.status == JobStatus.SUCCEEDED and enrichment_target(job) is not None]
    if not wanted:
        return set()
    created = dict(session.execute(
        select(Batch.id, Batch.created_at).where(Batch.id.in_({job.batch_id for job, _ in wanted}))
    ).all())
    now = utcnow()
    # One row per product and field set: a statement may not touch a row twice.
    merged: dict[tuple[str, str, tuple[str, ...]], dict[str, Any]] = {}
    for job, result in wanted:
        target = enrichment_of(job.request)
        if job.kind == JobKind.CLASSIFY:
            fields = {"category": result.label, "category_method": "llm",
                      "category_confidence": (result.label_probs or {}).get(result.label)}
        elif target.field == "attributes":
            fields = {"attributes": result.parsed,
                      "attributes_confidence": attribute_confidence(result.parsed, result.completions)}
        else:
            # the kept stop string may end in a space ("! "); the row holds the sentence alone
            fields = {"description": None if result.output_text is None else result.output_text.strip(),
                      "quality": description_quality(result.output_text)}
        decision = judge(target, is_classification=job.kind == JobKind.CLASSIFY, label=result.label,
                         output_text=result.output_text, parsed=result.parsed, finish_reason=result.finish_reason,
                         label_probs=result.label_probs)
        name = decision.field
        fields[f"{name}_decision"], fields[f"{name}_reasons"] = decision.decision, decision.reasons
        if target.product_fields is not None:
            fields["attributes_wanted"] = "attributes" in target.product_fields
        if target.fingerprint is not None:
            fields[f"{name}_fingerprint"] = target.fingerprint
        catalog, product_id = enrichment_target(job)
        row = dict(catalog=catalog, product_id=product_id, model=model, source_batch_id=job.batch_id,
                   source_batch_created_at=created.get(job.batch_id), updated_at=now, **fields)
        key = (catalog, product_id, tuple(sorted(fields)))
        kept = merged.get(key)
        if kept is None or _is_newer(row["source_batch_created_at"], kept["source_batch_created_at"]):
            merged[key] = row
    return _upsert(session, merged, model, now)


def record_votes(session: Session, catalog: str, votes: Sequence[Any], batch_id: Any, *, model: str,
                 review_below: Optional[float] = None, fingerprints: Optional[dict[str, str]] = None,
                 product_fields: Optional[list[str]] = None) -> set[tuple[str, str]]:
    """Upsert the categories the nearest-neighbour vote decided (the job spec's ``[classify]``
    method ``knn`` or ``hybrid``: no classification job runs for them), as ``batch_id``'s: with
    ``category_method = 'knn'``, the vote's share as ``category_confidence``, the decision of
    :func:`weir.jobs.catalog.decisions.judge_category` (``review`` below ``review_below``) and each
    product's fingerprint. Guarded like :func:`record_enrichments`: a newer batch's row is never
    overwritten. Call it in the transaction that stores nothing else, after the batch is stored.

    Args:
        votes: :class:`weir.jobs.catalog.enrichment.Vote` (``product_id``, ``label``, ``share``).
        product_fields: the fields the spec asks for (``attributes_wanted`` is set from it).

    Returns:
        The (catalog, product id) keys whose row was written.
    """
    created = session.execute(select(Batch.created_at).where(Batch.id == batch_id)).scalar_one()
    now = utcnow()
    merged: dict[tuple[str, str, tuple[str, ...]], dict[str, Any]] = {}
    for vote in votes:
        decision = judge_category(vote.label, vote.share, review_below)
        fields = {"category": vote.label, "category_method": "knn", "category_confidence": vote.share,
                  "category_decision": decision.decision, "category_reasons": decision.reasons}
        if product_fields is not None:
            fields["attributes_wanted"] = "attributes" in product_fields
        if fingerprints is not None:
            fields["category_fingerprint"] = fingerprints[vote.product_id]
        merged[(catalog, vote.product_id, tuple(sorted(fields)))] = dict(
            catalog=catalog, product_id=vote.product_id, model=model, source_batch_id=batch_id,
            source_batch_created_at=created, updated_at=now, **fields)
    return _upsert(session, merged, model, now)


def _upsert(session: Session, merged: dict[tuple[str, str, tuple[str, ...]], dict[str, Any]], model: str,
            now: datetime) -> set[tuple[str, str]]:
    """Write ``merged``'s rows (one per product and field set), a statement per field set."""
    dialect = session.get_bind().dialect.name
    written: set[tuple[str, str]] = set()
    for names_ in sorted({key[2] for key in merged}):
        rows = [dict(row, source_batch_id=uuid_literal(row["source_batch_id"], dialect),
                     source_batch_created_at=_time_literal(row["source_batch_created_at"], dialect),
                     updated_at=None)
                for key, row in sorted(merged.items()) if key[2] == names_]
        found = session.execute(_enrich_sql(dialect, names_), {"rows": json.dumps(rows), "model": model, "now": now})
        written.update((catalog, product_id) for catalog, product_id in found.all())
    return written


_ENRICH_TYPES = {"category": "text", "category_confidence": "float8", "category_method": "text", "description": "text", "quality": "text",
                 "attributes": "json", "category_fingerprint": "text", "description_fingerprint": "text",
                 "attributes_fingerprint": "text", "category_decision": "text", "category_reasons": "json",
                 "description_decision": "text", "description_reasons": "json", "attributes_decision": "text",
                 "attributes_reasons": "json", "attributes_wanted": "boolean", "attributes_confidence": "json"}


def enrichment_fingerprints(session: Session, catalog: str) -> dict[str, tuple[Optional[str], ...]]:
    """Product id -> (category, description, attributes) fingerprints of ``catalog``'s
    ``product_enrichment`` rows (None where a field was never written with one, or has no
    decision: written before decisions were, so it is enriched again)."""
    e = ProductEnrichment
    rows = session.execute(select(
        e.product_id, e.category_fingerprint, e.description_fingerprint, e.attributes_fingerprint,
        e.category_decision, e.description_decision, e.attributes_decision,
    ).where(e.catalog == catalog))
    return {product_id: tuple(fp if decision is not None else None for fp, decision in zip(rest[:3], rest[3:]))
            for product_id, *rest in rows}


@functools.lru_cache(maxsize=None)
def _enrich_sql(dialect: str, fields: tuple[str, ...]) -> Any:
    """The upsert of enrichment rows that set ``fields``, from a JSON array of rows (one
    statement, compiled once per field set), guarded so an older batch never overwrites."""
    columns = ("catalog", "product_id", *fields, "source_batch_id", "source_batch_created_at")
    kinds = {**_ENRICH_TYPES, "catalog": "text", "product_id": "text", "source_batch_id": "uuid", "source_batch_created_at": "timestamptz"}
    if dialect == "postgresql":
        source = ("FROM json_to_recordset(CAST(:rows AS json)) AS v("
                  + ", ".join(f"{c} {kinds[c]}" for c in columns) + ")")
        select_list = ", ".join(f"v.{c}" for c in columns)
    else:
        source = "FROM json_each(:rows) WHERE true"
        select_list = ", ".join(f"json_extract(value, '$.{c}')" for c in columns)
    updated = (*fields, "model", "source_batch_id", "source_batch_created_at", "updated_at")
    return text(
        f"INSERT INTO product_enrichment ({', '.join(columns)}, model, updated_at) "
        f"SELECT {select_list}, :model, :now {source} "
        "ON CONFLICT (catalog, product_id) DO UPDATE SET "
        + ", ".join(f"{c} = excluded.{c}" for c in updated)
        + " WHERE product_enrichment.source_batch_created_at IS NULL"
          " OR product_enrichment.source_batch_created_at <= excluded.source_batch_created_at"
          " RETURNING catalog, product_id"
    )


def _time_literal(value: Optional[datetime], dialect: str) -> Optional[str]:
    """How a timestamp column stores ``value``: ISO 8601 with its zone on Postgres; SQLite keeps
    SQLAlchemy's zone-less ``YYYY-MM-DD HH:MM:SS.ffffff`` text (all times here are UTC)."""
    if value is None:
        return None
    if dialect == "sqlite":
        return value.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
    return value.isoformat()


def _is_newer(a: Optional[datetime], b: Optional[datetime]) -> bool:
    return b is None or (a is not None and a >= b)
