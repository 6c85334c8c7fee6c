"""Benchmark workloads as defined for weir (W-gen, W-cls): inputs built from the real catalog."""

from __future__ import annotations

import csv
import os

DEFAULT_CATALOG = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "bigbasket_products.csv")

W_GEN_SYSTEM = (
    "You are a copywriter for an online grocery and household store. Given a product name and its "
    "brand, write exactly one short, factual sentence for the product page that says what the "
    "product is and what it is used for. Do not invent prices, sizes or health claims, do not use "
    "lists, and do not repeat the brand more than once."
)
W_GEN_MAX_TOKENS = 64


def catalog_rows(n: int, path: str = DEFAULT_CATALOG) -> list[dict]:
    """The first ``n`` rows of the catalog CSV as dicts (column names from its header)."""
    with open(path, encoding="utf-8", newline="") as f:
        return [r for _, r in zip(range(n), csv.DictReader(f))]


def w_gen_messages(n: int, path: str = DEFAULT_CATALOG) -> list[list[dict]]:
    """W-gen chat prompts: the fixed system prompt, then ``Product: ...\\nBrand: ...``."""
    return [[{"role": "system", "content": W_GEN_SYSTEM},
             {"role": "user", "content": f"Product: {r['product']}\nBrand: {r['brand']}"}]
            for r in catalog_rows(n, path)]
