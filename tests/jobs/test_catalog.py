"""Catalog reading (the real BigBasket export and its dirt), the two jobs per product, the summary."""

import os

import pytest

from weir.jobs.catalog import (
    CLASSIFY_HEADER, DESCRIBE_SYSTEM_PROMPT, Catalog, CatalogColumns, Product,
    product_requests, read_catalog, summarize,
)
from weir.jobs.model_info import PromptChecker
from weir.jobs.schemas import Enrichment

BIGBASKET = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "bigbasket_products.csv")
LABELS = [
    "Baby Care", "Bakery, Cakes & Dairy", "Beauty & Hygiene", "Beverages", "Cleaning & Household",
    "Eggs, Meat & Fish", "Foodgrains, Oil & Masala", "Fruits & Vegetables", "Gourmet & World Food",
    "Kitchen, Garden & Pets", "Snacks & Branded Foods",
]

BEVERAGE_HINTS = ["Tea", "Fruit Juices & Drinks"]  # the two commonest Beverages sub-categories

needs_bigbasket = pytest.mark.skipif(not os.path.exists(BIGBASKET), reason="../shared/data not present")


@needs_bigbasket
def test_reads_the_real_catalog():
    catalog = read_catalog(BIGBASKET)
    assert len(catalog.products) == 6079
    assert catalog.labels == LABELS
    first = catalog.products[0]
    assert (first.product_id, first.name, first.brand, first.category) == (
        "1", "Garlic Oil - Vegetarian Capsule 500 mg", "Sri Sri Ayurveda", "Beauty & Hygiene")
    assert not any(p.brand != p.brand.strip() for p in catalog.products)
    assert sum(1 for p in catalog.products if not p.description) == 25
    assert catalog.label_hints["Beverages"][:2] == BEVERAGE_HINTS


@needs_bigbasket
def test_limit_keeps_the_labels_of_the_whole_file():
    catalog = read_catalog(BIGBASKET, limit=3)
    assert [p.product_id for p in catalog.products] == ["1", "2", "3"]
    assert catalog.labels == LABELS


def test_crlf_quoted_multiline_and_other_column_names(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(
        b'sku,title,maker,dept,text\r\n'
        b'a1,Tea ,"Brand X  ",Drinks,"line one\r\nline two"\r\n'
        b'a2,Soap,Y,Home,\r\n'
        b',no id,Z,Garden,skipped\r\n'
    )
    columns = CatalogColumns(product="title", brand="maker", category="dept", description="text", id="sku")
    catalog = read_catalog(str(path), columns)
    assert catalog.products == [
        Product("a1", "Tea", "Brand X", "Drinks", "line one\r\nline two"),
        Product("a2", "Soap", "Y", "Home", ""),
    ]
    assert catalog.labels == ["Drinks", "Garden", "Home"]


def test_missing_column_is_named(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("index,product,category\n1,Tea,Drinks\n")
    with pytest.raises(ValueError, match=r"no column 'brand', 'description'"):
        read_catalog(str(path))


def test_two_jobs_per_product_with_fixed_prompts():
    product = Product("42", "Green Tea", "Leafy", "Beverages", "x" * 400)
    hints = {"Beverages": ["Tea", "Coffee"]}
    classify, describe = product_requests(product, ["Beverages", "Snacks"], hints, catalog="/data/shop.csv")
    assert classify.custom_id == "42/category" and describe.custom_id == "42/description"
    assert classify.labels == ["Beverages", "Snacks"]
    assert classify.prompt == CLASSIFY_HEADER + "Product: Green Tea\nCategory:"
    assert classify.system_prompt is None
    assert classify.label_texts == [" Beverages (Tea, Coffee)\n", " Snacks\n"]
    assert classify.engine_calibration_prompt() == CLASSIFY_HEADER + "Product: N/A\nCategory:"
    assert describe.prompt == "Product: Green Tea\nBrand: Leafy"
    assert describe.system_prompt == DESCRIBE_SYSTEM_PROMPT
    assert (describe.temperature, describe.max_tokens) == (0.0, 64)
    assert classify.metadata == describe.metadata == {"product_id": "42"}
    assert classify.enrichment == describe.enrichment == Enrichment(catalog="/data/shop.csv", product_id="42")


def test_describe_system_prompt_has_at_least_60_tokens(tiny_model_dir):
    checker = PromptChecker.for_model(tiny_model_dir)
    assert len(checker.encode(DESCRIBE_SYSTEM_PROMPT)) >= 60


def result(kind, status, product_id, label=None, prompt=0, cached=0, completion=0):
    return {"kind": kind, "status": status, "label": label, "num_prompt_tokens": prompt,
            "num_cached_tokens": cached, "num_completion_tokens": completion,
            "metadata": {"product_id": product_id}}


def test_summary_values():
    catalog = Catalog("c.csv", [
        Product("1", "a", "b", "Tea", ""), Product("2", "a", "b", "Tea", ""),
        Product("3", "a", "b", "Soap", ""), Product("4", "a", "b", "Soap", ""),
    ], ["Soap", "Tea"])
    results = [
        result("classify", "succeeded", "1", "Tea", prompt=100, cached=0),
        result("classify", "succeeded", "2", "Soap", prompt=100, cached=80),
        result("classify", "succeeded", "3", "Soap", prompt=100, cached=80),
        result("classify", "failed", "4", None, prompt=None, cached=None),
        result("generate", "succeeded", "1", prompt=50, cached=0, completion=10),
        result("generate", "succeeded", "2", prompt=50, cached=40, completion=30),
    ]
    summary = summarize(catalog, results, wall_s=2.0)
    assert (summary.num_products, summary.num_succeeded, summary.num_failed) == (4, 5, 1)
    assert (summary.num_generated_tokens, summary.generated_tokens_per_s) == (40, 20.0)
    assert summary.prefix_cache_hit_rate == pytest.approx(200 / 400)
    assert (summary.num_classified, summary.accuracy) == (3, pytest.approx(2 / 3))
    assert (summary.majority_label, summary.majority_baseline) == ("Tea", pytest.approx(2 / 3))
    text = summary.format()
    assert "5 succeeded, 1 failed" in text and "66.7 %" in text and "20.0 tokens/s" in text


def test_summary_of_nothing():
    summary = summarize(Catalog("c.csv", [], ["x"]), [], wall_s=0.0)
    assert (summary.accuracy, summary.prefix_cache_hit_rate, summary.generated_tokens_per_s) == (None, None, None)
    assert "n/a" in summary.format()
