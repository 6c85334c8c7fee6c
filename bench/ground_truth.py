"""The shipped catalogs' own ground truth for attribute extraction, and how an answer is matched
against it: Flipkart's ``product_specifications`` column (a Ruby-hash literal of ``{"key"=>...,
"value"=>...}`` pairs), BigBasket's ``brand`` column. Used by ``bench.extraction`` and the tests;
not part of the installed package.
"""

from __future__ import annotations

import csv
import re
from typing import Any, Iterable

from weir.jobs.catalog.grounding import words as grounding_words

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



def normalise(value: Any) -> str:
    """Case-folded, whitespace-collapsed text of a value."""
    return " ".join(str(value).casefold().split())


def values_match(pred: Any, truth: str) -> bool:
    """Equal after :func:`normalise` (numbers as numbers), or one holds the other as whole words
    (case, plural and possessive aside: "Baby Girl's" holds "Baby Girls")."""
    p, t = normalise(pred), normalise(truth)
    if not p:
        return False
    try:
        return float(p) == float(t)
    except ValueError:
        pass
    if p == t:
        return True
    def words(text: str) -> str:  # "Girl's" = "girls" = "girl" (weir.jobs.catalog.grounding.words)
        return f" {' '.join(grounding_words(text))} "
    wp, wt = words(p), words(t)
    return wp.strip() != "" and wt.strip() != "" and (wp in wt or wt in wp)
