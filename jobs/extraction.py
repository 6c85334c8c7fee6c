"""Attribute extraction: a JSON schema per catalog, the prompt that asks a product's attributes,
and the catalogs' own ground truth to score them against.

The output is constrained by the schema (``SamplingParams.structured_outputs``), so every finished
output parses and validates; the schema's fields are nullable so that the model can say a text
does not tell. Ground truth: Flipkart's ``product_specifications`` column (a Ruby-hash literal of
``{"key"=>..., "value"=>...}`` pairs), BigBasket's ``brand`` column.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

DESCRIPTION_CHARS = 400

EXTRACTION_SYSTEM_PROMPT = (
    "You read product listings and extract their attributes as JSON. Copy values from the listing "
    "as written; use null for an attribute the listing does not state."
)


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def object_schema(properties: dict[str, dict]) -> dict:
    """Every property required (in this order) and nullable; no other property."""
    return {"type": "object", "additionalProperties": False, "required": list(properties),
            "properties": {k: nullable(v) for k, v in properties.items()}}


TEXT = {"type": "string", "minLength": 1, "maxLength": 40}


@dataclass(frozen=True)
class ExtractionSpec:
    """What to extract from one catalog and where its ground truth is.

    Attributes:
        file: CSV file name under the shared data folder.
        id, name, description: column names.
        schema: the JSON Schema of one product's attributes.
        truth_fields: schema field -> ground-truth key (a ``product_specifications`` key, or
            ``column:NAME`` for a CSV column).
    """

    file: str
    id: str
    name: str
    description: str
    schema: dict
    truth_fields: dict[str, str]


CATALOG_EXTRACTION = {
    "flipkart": ExtractionSpec(
        file="flipkart_products.csv", id="uniq_id", name="product_name", description="description",
        schema=object_schema({"brand": TEXT, "type": TEXT, "color": TEXT, "material": TEXT,
                              "ideal_for": TEXT, "model_name": TEXT,
                              "pack_of": {"type": "integer", "minimum": 1, "maximum": 100}}),
        truth_fields={"brand": "Brand", "type": "Type", "color": "Color", "material": "Material",
                      "ideal_for": "Ideal For", "model_name": "Model Name", "pack_of": "Pack of"}),
    "bigbasket": ExtractionSpec(
        file="bigbasket_products.csv", id="index", name="product", description="description",
        schema=object_schema({"brand": TEXT, "quantity": {"type": "number", "minimum": 0},
                              "unit": {"enum": ["g", "kg", "ml", "l", "pcs"]},
                              "pack_size": {"type": "integer", "minimum": 1, "maximum": 100}}),
        truth_fields={"brand": "column:brand"}),
}

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


@dataclass(frozen=True)
class ExtractionProduct:
    product_id: str
    name: str
    description: str
    truth: dict[str, str] = field(default_factory=dict)


def read_products(path: str, spec: ExtractionSpec, limit: Optional[int] = None) -> list[ExtractionProduct]:
    """The first ``limit`` rows of the catalog with their ground truth (keys of ``truth_fields``'
    values; empty values left out)."""
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if limit is not None and len(out) >= limit:
                break
            specs = parse_specifications(row.get("product_specifications", ""))
            truth = {}
            for key in spec.truth_fields.values():
                value = row.get(key[len("column:"):], "") if key.startswith("column:") else specs.get(key, "")
                if value and value.strip():
                    truth[key] = value.strip()
            out.append(ExtractionProduct(row[spec.id].strip(), row[spec.name].strip(),
                                         (row.get(spec.description) or "").strip(), truth))
    return out


def listing_text(name: str, description: str) -> str:
    description = " ".join(description.split())[:DESCRIPTION_CHARS]
    return f"Product: {name}\nDescription: {description or 'none'}"


# one worked example (shown before every product: a shared, cached prefix) with nulls where the
# listing is silent, so that a small model copies values instead of repeating the name in each field
EXAMPLE_LISTING = listing_text(
    "Acme Steel Water Bottle, 750 ml (Pack of 2)",
    "Acme presents a leak-proof steel water bottle in blue. Keeps drinks cold for 12 hours.")
EXAMPLE_VALUES = {"brand": "Acme", "type": "Water Bottle", "color": "Blue", "material": "Steel",
                  "ideal_for": None, "model_name": None, "pack_of": 2, "quantity": 750, "unit": "ml",
                  "pack_size": 2}


def extraction_messages(product: ExtractionProduct, spec: ExtractionSpec) -> list[dict]:
    """Chat messages asking for ``product``'s attributes (the schema's field names, in order),
    after one worked example of the same schema."""
    fields = list(spec.schema["properties"])
    example = json.dumps({k: EXAMPLE_VALUES.get(k) for k in fields}, separators=(", ", ": "))
    return [{"role": "system", "content": f"{EXTRACTION_SYSTEM_PROMPT} Fields: {', '.join(fields)}."},
            {"role": "user", "content": EXAMPLE_LISTING},
            {"role": "assistant", "content": example},
            {"role": "user", "content": listing_text(product.name, product.description)}]


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
