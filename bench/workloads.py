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


W_CLS_DESCRIPTION_CHARS = 300
W_CLS_MISSING = "unknown"
W_CLS_CALIBRATION = "N/A"


def _field(row: dict, key: str) -> str:
    """A CSV field with surrounding whitespace stripped; missing, empty or NaN becomes ``unknown``."""
    value = row.get(key)
    value = "" if value is None else str(value).strip()
    return W_CLS_MISSING if value == "" or value.lower() == "nan" else value


def w_cls_labels(path: str = DEFAULT_CATALOG) -> list[str]:
    """W-cls labels: the distinct top-level categories of the whole catalog, sorted (11 for BigBasket)."""
    with open(path, encoding="utf-8", newline="") as f:
        return sorted({r["category"].strip() for r in csv.DictReader(f) if (r.get("category") or "").strip()})


def w_cls_system(labels: list[str]) -> str:
    """The fixed W-cls system prompt naming every category, one per line."""
    return ("You sort the products of an online grocery and household store into categories. The "
            "user gives a product's name, brand and description. Answer with exactly one of these "
            "category names, written as listed, and nothing else:\n"
            + "\n".join(f"- {lab}" for lab in labels))


def w_cls_user(product: str, brand: str, description: str) -> str:
    return f"Product: {product}\nBrand: {brand}\nDescription: {description}"


def w_cls_messages(n: int, labels: list[str], path: str = DEFAULT_CATALOG) -> tuple[list[list[dict]], list[str]]:
    """W-cls chat prompts of the first ``n`` products and their ``category`` (the ground truth).

    The user message is ``Product: ...\\nBrand: ...\\nDescription: ...`` with the description cut
    to its first 300 characters.
    """
    system = w_cls_system(labels)
    prompts, truth = [], []
    for r in catalog_rows(n, path):
        desc = _field(r, "description")[:W_CLS_DESCRIPTION_CHARS]
        user = w_cls_user(_field(r, "product"), _field(r, "brand"), desc)
        prompts.append([{"role": "system", "content": system}, {"role": "user", "content": user}])
        truth.append(_field(r, "category"))
    return prompts, truth


def w_cls_calibration_messages(labels: list[str]) -> list[dict]:
    """The content-free W-cls prompt (``N/A`` in every field) for contextual calibration."""
    na = W_CLS_CALIBRATION
    return [{"role": "system", "content": w_cls_system(labels)}, {"role": "user", "content": w_cls_user(na, na, na)}]
