"""Attribute extraction's ground truth and scoring (exact values on the shared catalogs)."""

import json
import os

import jsonschema
import pytest

from weir.jobs.extraction import (CATALOG_EXTRACTION, ExtractionProduct, extraction_messages, parse_specifications,
                                  read_products, values_match)

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")


def test_parse_specifications_reads_the_ruby_hash_literal():
    text = ('{"product_specification"=>[{"key"=>"Brand", "value"=>"Elegance"}, {"key"=>"Color", '
            '"value"=>"Multi \\"Mix\\""}, {"key"=>"Brand", "value"=>"Other"}, {"value"=>"no key"}]}')
    assert parse_specifications(text) == {"Brand": "Elegance", "Color": 'Multi \\"Mix\\"'}
    assert parse_specifications("") == {}


@pytest.mark.parametrize("pred, truth, ok", [
    ("Nike", "nike", True), ("Nike", "Nike Inc", True), ("Nike Inc.", "Nike", True),
    ("Nik", "Nike", False), ("2", "2.0", True), (2, "2", True), ("", "x", False),
    ("Blue", "Dark Blue", True), ("Steel", "Stainless Steel", True), ("Red", "Blue", False),
])
def test_values_match(pred, truth, ok):
    assert values_match(pred, truth) is ok


@pytest.mark.skipif(not os.path.exists(os.path.join(DATA, "flipkart_products.csv")), reason="no shared data")
def test_flipkart_ground_truth_of_the_first_product():
    spec = CATALOG_EXTRACTION["flipkart"]
    first = read_products(os.path.join(DATA, spec.file), spec, 1)[0]
    assert first.name == "Elegance Polyester Multicolor Abstract Eyelet Door Curtain"
    assert first.truth == {"Brand": "Elegance", "Type": "Eyelet", "Color": "Multicolor", "Material": "Polyester",
                           "Model Name": "Abstract Polyester Door Curtain Set Of 2"}


def test_example_and_schema_agree():
    """The worked example every prompt shows validates against each catalog's schema."""
    for spec in CATALOG_EXTRACTION.values():
        messages = extraction_messages(ExtractionProduct("1", "n", "d"), spec)
        jsonschema.validate(json.loads(messages[2]["content"]), spec.schema)
        assert list(json.loads(messages[2]["content"])) == list(spec.schema["properties"])
