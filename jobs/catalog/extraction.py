"""Attribute extraction: the prompt that asks a product's attributes under the job spec's schema
(``[extract]``, :class:`weir.jobs.catalog.spec.Extract`), and the catalogs' own ground truth to score the
answers against.

The output is constrained by the schema (``SamplingParams.structured_outputs``), so every finished
output parses and validates; the schema's fields are nullable so that the model can say a listing
does not tell. Ground truth: Flipkart's ``product_specifications`` column (a Ruby-hash literal of
``{"key"=>..., "value"=>...}`` pairs), BigBasket's ``brand`` column.
"""

from __future__ import annotations

import csv
import json
import re
from typing import Any, Iterable

from weir.jobs.catalog.spec import Extract

TRUTH_FIELDS = {
    "flipkart": {"brand": "Brand", "type": "Type", "color": "Color", "material": "Material",
                 "ideal_for": "Ideal For", "model_name": "Model Name", "pack_of": "Pack of"},
    "bigbasket": {"brand": "column:brand"},
}
"""Per shipped spec: schema field -> where its ground truth is (a ``product_specifications`` key,
or ``column:NAME`` for a CSV column)."""

_PAIR = re.compile(r'"key"=>"((?:[^"\\]|\\.)*)",\s*"value"=>"((?:[^"\\]|\\.)*)"')


def parse_specifications(text: str) -> dict[str, str]:
    """Flipkart's ``product_specifications`` as a dict (first value of a repeated key kept).

    >>> parse_specifications('{"product_specification"=>[{"key"=>"Brand", "value"=>"Nike"}]}')
    {'Brand': 'Nike'}
    """
    out: dict[str, str] = {}
    for key, value in _PAIR.findall(text or ""):
        out.setdefault(key.strip(), value.strip())
    return out


def read_truth(path: str, id_column: str, truth_fields: dict[str, str],
               ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """The ground truth of the products ``ids`` of a catalog CSV: product id -> {truth key: value}
    (the keys are ``truth_fields``' values; empty values left out)."""
    wanted = set(ids)
    out: dict[str, dict[str, str]] = {}
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for row in csv.DictReader(f):
            product_id = (row.get(id_column) or "").strip()
            if product_id not in wanted or product_id in out:
                continue
            specs = parse_specifications(row.get("product_specifications", ""))
            truth = {}
            for key in truth_fields.values():
                value = row.get(key[len("column:"):], "") if key.startswith("column:") else specs.get(key, "")
                if value and value.strip():
                    truth[key] = value.strip()
            out[product_id] = truth
    return out


def listing_text(name: str, description: str, description_chars: int) -> str:
    """What the model reads of one product: its name and the first ``description_chars``
    characters of its description (whitespace collapsed; ``none`` when empty)."""
    description = " ".join(description.split())[:description_chars]
    return f"Product: {name}\nDescription: {description or 'none'}"


def extraction_messages(extract: Extract, shop: str, name: str, description: str) -> list[dict[str, str]]:
    """Chat messages asking for one product's attributes: the system prompt (naming the fields in
    order), then the worked examples (each a listing and its answer; the same for every product,
    so a cached prefix), then the product's listing."""
    system = f"{extract.system_prompt.format(shop=shop)} Fields: {', '.join(extract.fields)}."
    messages = [{"role": "system", "content": system}]
    for example_name, example_description, answer in extract.worked_examples():
        messages.append({"role": "user", "content": listing_text(example_name, example_description,
                                                                 extract.description_chars)})
        messages.append({"role": "assistant", "content": json.dumps(answer, separators=(", ", ": "), ensure_ascii=False)})
    messages.append({"role": "user", "content": listing_text(name, description, extract.description_chars)})
    return messages


def normalise(value: Any) -> str:
    """Case-folded, whitespace-collapsed text of a value."""
    return " ".join(str(value).casefold().split())


def values_match(pred: Any, truth: str) -> bool:
    """Equal after :func:`normalise` (numbers as numbers), or one holds the other as whole words."""
    p, t = normalise(pred), normalise(truth)
    if not p:
        return False
    try:
        return float(p) == float(t)
    except ValueError:
        pass
    if p == t:
        return True
    words = lambda s: f" {re.sub(r'[^0-9a-z]+', ' ', s).strip()} "  # noqa: E731
    wp, wt = words(p), words(t)
    return wp.strip() != "" and wt.strip() != "" and (wp in wt or wt in wp)
