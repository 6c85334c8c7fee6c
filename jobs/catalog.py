"""Catalog enrichment: one classification and one description job per product, and their summary.

The catalog is a CSV file (the BigBasket export: UTF-8, CRLF, quoted multi-line descriptions) read
with the csv module. Real dirt is kept as it is (mojibake, empty descriptions) except for
surrounding whitespace, which is stripped from every field (363 brands end in spaces).

Prompts follow the project's catalog workloads: a fixed system prompt per task, so every request of
a kind shares its longest prefix and the engine's prefix cache serves it.
"""

from __future__ import annotations

import csv
import os
from collections import Counter
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from weir.jobs.schemas import ClassifyRequest, Enrichment, GenerateRequest, JobRequest

DESCRIPTION_MAX_TOKENS = 64

DESCRIBE_SYSTEM_PROMPT = (
    "You are a copywriter for an online grocery and household store. For the product the user "
    "names, write exactly one sentence for its product page. Say what the product is and why a "
    "shopper would want it, in a warm, factual tone, and mention the brand once. Do not invent "
    "prices, weights, ingredients, certifications or health claims, do not use lists, emojis or "
    "quotation marks, and write nothing after the sentence."
)


CLASSIFY_HEADER = "Products of an online grocery store and their categories.\n\n"
"""The fixed text every classification prompt starts with (one shared, cached prefix)."""

NUM_LABEL_HINTS = 6


def classify_prompt(name: str) -> str:
    """The classification prompt of one product: a catalog line the category completes."""
    return f"{CLASSIFY_HEADER}Product: {name}\nCategory:"


def label_text(label: str, hints: list[str]) -> str:
    """What is scored for a label: the category name, its commonest sub-categories, a newline."""
    return f" {label} ({', '.join(hints)})\n" if hints else f" {label}\n"


@dataclass(frozen=True)
class CatalogColumns:
    """Which CSV column holds which field (defaults: the BigBasket export's names)."""

    product: str = "product"
    brand: str = "brand"
    category: str = "category"
    description: str = "description"
    id: str = "index"
    sub_category: str = "sub_category"


@dataclass(frozen=True)
class Product:
    """One catalog row, whitespace-stripped. ``category`` is the catalog's own (the ground truth)."""

    product_id: str
    name: str
    brand: str
    category: str
    description: str


@dataclass(frozen=True)
class Catalog:
    """Products to enrich, and the label set: every distinct non-empty category of the whole file,
    sorted (also when only the first ``limit`` products are enriched). ``label_hints`` names each
    category's commonest sub-categories (the catalog's own taxonomy, when it has that column)."""

    path: str
    products: list[Product]
    labels: list[str]
    label_hints: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def read_catalog(
    path: str, columns: CatalogColumns = CatalogColumns(), limit: Optional[int] = None
) -> Catalog:
    """Read a catalog CSV.

    Args:
        path: CSV file with a header row.
        columns: the names of the columns to use.
        limit: keep only the first ``limit`` products (rows without an id or a name are skipped).

    Returns:
        The catalog; labels are taken from every row of the file.

    Raises:
        ValueError: a named column is missing from the header, or the file has no category.
        OSError: the file cannot be read.
    """
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        wanted = [columns.id, columns.product, columns.brand, columns.category, columns.description]
        missing = [name for name in wanted if name not in header]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(map(repr, missing))}; header is {header}")
        products: list[Product] = []
        categories: set[str] = set()
        subs: dict[str, Counter] = {}
        for row in reader:
            field = {name: (row.get(name) or "").strip() for name in wanted}
            sub = (row.get(columns.sub_category) or "").strip()
            if field[columns.category]:
                categories.add(field[columns.category])
                if sub:
                    subs.setdefault(field[columns.category], Counter())[sub] += 1
            if not field[columns.id] or not field[columns.product]:
                continue
            if limit is None or len(products) < limit:
                products.append(
                    Product(
                        product_id=field[columns.id],
                        name=field[columns.product],
                        brand=field[columns.brand],
                        category=field[columns.category],
                        description=field[columns.description],
                    )
                )
    if not categories:
        raise ValueError(f"{path}: column {columns.category!r} is empty in every row")
    hints = {c: [name for name, _ in counts.most_common(NUM_LABEL_HINTS)] for c, counts in subs.items()}
    return Catalog(path=path, products=products, labels=sorted(categories), label_hints=hints)


def product_requests(product: Product, labels: list[str],
                     label_hints: Optional[dict[str, list[str]]] = None, *, catalog: str) -> list[JobRequest]:
    """The two jobs of one product: classify it into ``labels``, describe it in one sentence.

    Classification is choice scoring of each category (with its sub-category hints) as the
    completion of a catalog line ``Product: <name>\nCategory:``, calibrated against the same line
    for ``N/A``: SmolLM2-135M answers chat-style category questions no better than chance, while
    calibrated completion scoring is well above the majority class.

    ``custom_id`` is ``<product_id>/category`` and ``<product_id>/description``; both carry
    ``metadata["product_id"]``, and are marked as enrichment of (``catalog``, product id), so the
    worker fills that product's row of that catalog.
    """
    metadata = {"product_id": product.product_id}
    enrichment = Enrichment(catalog=catalog, product_id=product.product_id)
    label_hints = label_hints or {}
    classify = ClassifyRequest(
        custom_id=f"{product.product_id}/category",
        prompt=classify_prompt(product.name),
        labels=labels,
        label_texts=[label_text(label, label_hints.get(label, [])) for label in labels],
        calibration_prompt=classify_prompt("N/A"),
        metadata=metadata,
        enrichment=enrichment,
    )
    describe = GenerateRequest(
        custom_id=f"{product.product_id}/description",
        system_prompt=DESCRIBE_SYSTEM_PROMPT,
        prompt=f"Product: {product.name}\nBrand: {product.brand}",
        temperature=0.0,
        max_tokens=DESCRIPTION_MAX_TOKENS,
        metadata=metadata,
        enrichment=enrichment,
    )
    return [classify, describe]


def catalog_key(catalog: Catalog) -> str:
    """The ``product_enrichment.catalog`` of a catalog's rows: its file's absolute path."""
    return os.path.abspath(catalog.path)


def catalog_requests(catalog: Catalog) -> list[JobRequest]:
    """Every product's two requests, product by product."""
    key = catalog_key(catalog)
    return [r for product in catalog.products
            for r in product_requests(product, catalog.labels, catalog.label_hints, catalog=key)]


def enqueue_catalog(client: Any, catalog: Catalog, *, idempotency_key: Optional[str] = None) -> Any:
    """Enqueue one enrichment batch for ``catalog`` through a :class:`weir.jobs.client.Client`.

    Args:
        idempotency_key: when a batch with this key exists, nothing is enqueued and its id is
            returned (the nightly run's catalog and slot).

    Returns:
        The batch id.

    Raises:
        ValueError: two products share an id (their custom_ids collide); nothing was stored.
    """
    return client.enqueue_batch(
        catalog_requests(catalog),
        metadata={
            "kind": "catalog_enrichment",
            "catalog": catalog.path,
            "num_products": len(catalog.products),
            "labels": catalog.labels,
        },
        idempotency_key=idempotency_key,
    )


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
    num_generated_tokens: int
    generated_tokens_per_s: Optional[float]
    prefix_cache_hit_rate: Optional[float]
    num_classified: int
    accuracy: Optional[float]
    majority_label: Optional[str]
    majority_baseline: Optional[float]

    def format(self) -> str:
        def pct(x: Optional[float]) -> str:
            return "n/a" if x is None else f"{100 * x:.1f} %"

        rate = "n/a" if self.generated_tokens_per_s is None else f"{self.generated_tokens_per_s:.1f}"
        return "\n".join(
            [
                f"products:            {self.num_products}",
                f"jobs:                {self.num_succeeded} succeeded, {self.num_failed} failed",
                f"wall time:           {self.wall_s:.1f} s",
                f"generated tokens:    {self.num_generated_tokens} ({rate} tokens/s)",
                f"prefix-cache hits:   {pct(self.prefix_cache_hit_rate)} of prompt tokens",
                f"category accuracy:   {pct(self.accuracy)} over {self.num_classified} products "
                f"(majority baseline {pct(self.majority_baseline)}: {self.majority_label})",
            ]
        )


def summarize(catalog: Catalog, results: Iterable[dict[str, Any]], wall_s: float) -> EnrichmentSummary:
    """Summarize a finished enrichment batch.

    Args:
        catalog: the catalog the batch was built from (its categories are the ground truth).
        results: the batch's rows as :meth:`weir.jobs.client.Client.results` returns them.
        wall_s: seconds from enqueue to the batch's end.

    Accuracy counts succeeded classification jobs whose label equals the product's catalog
    category; the majority baseline is the share of the most common category among those products.
    """
    results = list(results)
    truth = {p.product_id: p.category for p in catalog.products}
    num_generated = sum(r["num_completion_tokens"] or 0 for r in results if r["kind"] == "generate")
    num_prompt = sum(r["num_prompt_tokens"] or 0 for r in results)
    num_cached = sum(r["num_cached_tokens"] or 0 for r in results)
    classified = [
        r for r in results if r["kind"] == "classify" and r["status"] == "succeeded"
    ]
    categories = [truth.get(str(r["metadata"].get("product_id")), "") for r in classified]
    num_correct = sum(r["label"] == category for r, category in zip(classified, categories))
    majority = Counter(categories).most_common(1)
    return EnrichmentSummary(
        num_products=len(catalog.products),
        num_succeeded=sum(r["status"] == "succeeded" for r in results),
        num_failed=sum(r["status"] == "failed" for r in results),
        wall_s=wall_s,
        num_generated_tokens=num_generated,
        generated_tokens_per_s=num_generated / wall_s if wall_s > 0 else None,
        prefix_cache_hit_rate=num_cached / num_prompt if num_prompt else None,
        num_classified=len(classified),
        accuracy=num_correct / len(classified) if classified else None,
        majority_label=majority[0][0] if majority else None,
        majority_baseline=majority[0][1] / len(classified) if majority else None,
    )
