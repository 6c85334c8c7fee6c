"""Attribute extraction's ground truth and scoring (exact values on the shared catalogs)."""

import json
import os

import jsonschema
import pytest

from weir.jobs.catalog.enrichment import extract_request, read_catalog
from bench.ground_truth import TRUTH_FIELDS, parse_specifications, read_truth, values_match
from weir.jobs.catalog.spec import load_spec

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
    path = os.path.join(DATA, "flipkart_products.csv")
    spec = load_spec("flipkart")
    first = read_catalog(path, spec, limit=1).products[0]
    assert first.name == "Elegance Polyester Multicolor Abstract Eyelet Door Curtain"
    assert read_truth(path, spec.columns.id, TRUTH_FIELDS["flipkart"], [first.product_id]) == {first.product_id: {
        "Brand": "Elegance", "Type": "Eyelet", "Color": "Multicolor", "Material": "Polyester",
        "Model Name": "Abstract Polyester Door Curtain Set Of 2"}}


@pytest.mark.parametrize("name", ["flipkart", "bigbasket"])
def test_example_and_schema_agree(name):
    """The worked examples every prompt shows validate against the shipped spec's schema, with
    their fields in the schema's order, and the scored fields are the schema's."""
    spec = load_spec(name)
    from weir.jobs.catalog.enrichment import Product

    request = extract_request(Product("1", "n", "b", "", "d"), spec, "c")
    for message in (request.prompt[2], request.prompt[4]):
        example = json.loads(message.content)
        jsonschema.validate(example, spec.extract.schema)
        assert list(example) == list(spec.extract.schema["properties"])
    assert set(TRUTH_FIELDS[name]) <= set(spec.extract.fields)
