"""Catalog reading (the real BigBasket export and its dirt), the two jobs per product, the summary."""

import os

import pytest

import dataclasses

from weir.jobs.catalog.enrichment import (
    Catalog, CatalogEncodingError, Product, catalog_requests, classify_header, exemplar_index, label_path, product_requests,
    listing_of, read_catalog, read_taxonomy_file, summarize,
)
from weir.jobs.catalog.decisions import annotate_result
from weir.jobs.catalog.grounding import Listing
from weir.jobs.catalog.exemplars import ExemplarIndex, Labelled
from weir.jobs.model_info import PromptChecker
from weir.jobs.catalog.marker import Enrichment, enrichment_of
from weir.jobs.catalog.spec import DESCRIBE_SYSTEM_PROMPT, JobSpec, Taxonomy, load_spec

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
BIGBASKET = os.path.join(DATA, "bigbasket_products.csv")
FLIPKART = os.path.join(DATA, "flipkart_products.csv")
GOOGLE_TAXONOMY = os.path.join(DATA, "google_product_taxonomy.txt")
LABELS = [
    "Baby Care", "Bakery, Cakes & Dairy", "Beauty & Hygiene", "Beverages", "Cleaning & Household",
    "Eggs, Meat & Fish", "Foodgrains, Oil & Masala", "Fruits & Vegetables", "Gourmet & World Food",
    "Kitchen, Garden & Pets", "Snacks & Branded Foods",
]

BEVERAGE_HINTS = ["Tea", "Fruit Juices & Drinks"]  # the two commonest Beverages sub-categories

needs_bigbasket = pytest.mark.skipif(not os.path.exists(BIGBASKET), reason="../shared/data not present")


@needs_bigbasket
def test_reads_the_real_catalog():
    catalog = read_catalog(BIGBASKET, load_spec("bigbasket"))
    assert len(catalog.products) == 6079
    assert catalog.labels == LABELS
    first = catalog.products[0]
    assert (first.product_id, first.name, first.brand, first.category) == (
        "1", "Garlic Oil - Vegetarian Capsule 500 mg", "Sri Sri Ayurveda", "Beauty & Hygiene")
    assert not any(p.brand != p.brand.strip() for p in catalog.products)
    assert sum(1 for p in catalog.products if not p.description) == 25
    assert catalog.label_hints["Beverages"][:2] == BEVERAGE_HINTS
    assert len(catalog.pool) == 6079


@pytest.mark.skipif(not os.path.exists(FLIPKART), reason="../shared/data not present")
def test_reads_flipkart_level_one_from_the_category_tree():
    catalog = read_catalog(FLIPKART, load_spec("flipkart"))
    assert len(catalog.products) == 1050
    assert catalog.labels == ["Baby Care", "Beauty and Personal Care", "Computers", "Home Decor & Festive Needs",
                              "Home Furnishing", "Kitchen & Dining", "Watches"]
    assert catalog.products[0].category == "Home Furnishing"
    assert catalog.label_hints["Watches"][0] == "Wrist Watches"


def test_label_path():
    tree = Taxonomy(json_list=True, separator=">>")
    assert label_path('["Home Furnishing >> Curtains & Accessories >> Curt..."]', tree) == [
        "Home Furnishing", "Curtains & Accessories", "Curt..."]
    assert label_path("not json", tree) == []
    assert label_path("", Taxonomy()) == []
    assert label_path(" Tea ", Taxonomy()) == ["Tea"]


@pytest.mark.skipif(not os.path.exists(GOOGLE_TAXONOMY), reason="../shared/data not present")
def test_taxonomy_file_labels_for_a_catalog_without_any(tmp_path):
    labels, hints = read_taxonomy_file(GOOGLE_TAXONOMY, 1)
    assert len(labels) == 21 and labels[0] == "Animals & Pet Supplies"
    assert hints["Animals & Pet Supplies"] == ["Live Animals", "Pet Supplies"]
    path = tmp_path / "c.csv"
    path.write_text("index,product,brand,description\n1,Dog Lead,Paws,\n")
    spec = JobSpec(taxonomy=Taxonomy(source="file", file=GOOGLE_TAXONOMY))
    catalog = read_catalog(str(path), spec)
    assert catalog.pool == [] and catalog.labels == labels
    (classify, _), = [catalog_requests(catalog)]
    assert classify.labels == labels and classify.calibration_prompt is not None  # zero-shot


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
    spec = JobSpec(taxonomy=Taxonomy(column="dept")).with_columns(name="title", brand="maker", description="text", id="sku")
    catalog = read_catalog(str(path), spec)
    assert catalog.products == [
        Product("a1", "Tea", "Brand X", "Drinks", "line one\r\nline two"),
        Product("a2", "Soap", "Y", "Home", ""),
    ]
    assert catalog.labels == ["Drinks", "Garden", "Home"]


def test_missing_column_is_named(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("index,title,brand\n1,Tea,Drinks\n")
    with pytest.raises(ValueError) as info:
        read_catalog(str(path), JobSpec(taxonomy=Taxonomy(hint_column="sub")))
    assert str(info.value) == f"{path}: no column 'product', 'category', 'sub'; header is ['index', 'title', 'brand']"


def test_a_catalog_with_only_an_id_a_name_and_a_category(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("index,product,category\n1,Green Tea,Drinks\n2,Black Tea,Drinks\n")
    catalog = read_catalog(str(path))
    assert catalog.products == [Product("1", "Green Tea", "", "Drinks", ""), Product("2", "Black Tea", "", "Drinks", "")]
    assert catalog.absent_columns == {"brand": "brand", "description": "description"}
    classify, describe = product_requests(catalog.products[0], catalog, exemplar_index(catalog))
    assert classify.prompt == ("Products of an online shop and their categories.\n\n"
                               "Product: Black Tea\nCategory: Drinks\n\nProduct: Green Tea\nCategory:")
    assert describe.prompt == ("Product: Green Tea\n\nWrite one full sentence, not a title, that tells a "
                               "shopper what this product is and why they would want it, using only facts from the "
                               "listing.")
    # a spec may say the catalog has no such column; one column it names and the file has is read
    spec = JobSpec().with_columns(brand="", description="category")
    catalog = read_catalog(str(path), spec)
    assert catalog.absent_columns == {}
    assert catalog.products[0] == Product("1", "Green Tea", "", "Drinks", "Drinks")


def test_a_latin_1_catalog_is_refused_naming_line_and_byte_unless_its_encoding_is_given(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(b"index,product,category\n1,Green Tea,Drinks\n2,Caf\xe9 Noir,Drinks\n")
    with pytest.raises(CatalogEncodingError) as info:
        read_catalog(str(path))
    assert str(info.value) == (
        f"{path}: line 3, byte offset 47: 0xe9 is not valid utf-8; convert the file to UTF-8 (iconv -f LATIN1 "
        "-t UTF-8 in.csv > out.csv) or give its encoding (weir enrich --encoding latin-1)")
    assert (info.value.line, info.value.offset) == (3, 47)
    assert [p.name for p in read_catalog(str(path), encoding="latin-1").products] == ["Green Tea", "Café Noir"]
    with pytest.raises(ValueError, match="^unknown encoding 'latin-9000' "):
        read_catalog(str(path), encoding="latin-9000")


@pytest.mark.parametrize("encoding", ["rot13", "base64", "hex", "zlib", "bz2", "uu"])
def test_a_codec_that_is_not_a_text_encoding_is_refused_by_name(tmp_path, encoding):
    path = tmp_path / "c.csv"
    path.write_text("index,product,category\n1,Tea,Drinks\n")
    with pytest.raises(ValueError) as info:
        read_catalog(str(path), encoding=encoding)
    assert type(info.value) is ValueError
    assert str(info.value) == (f"encoding {encoding!r} is not a text encoding (a Python text codec name: utf-8, "
                               "latin-1, cp1252, ...)")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf_16_or_32_catalog_without_a_byte_order_mark_is_named_with_the_fix(tmp_path, encoding):
    path = tmp_path / "c.csv"
    path.write_bytes("index,product,category\n1,Tea,Drinks\n".encode(f"{encoding}-le"))
    with pytest.raises(CatalogEncodingError) as info:
        read_catalog(str(path), encoding=encoding)
    stream = encoding.upper()
    assert str(info.value) == (f"{path}: not valid {encoding}: {stream} stream does not start with BOM; name its "
                               f"byte order (weir enrich --encoding {encoding}-le or {encoding}-be)")
    assert (info.value.path, info.value.line, info.value.offset) == (str(path), None, None)
    assert [p.name for p in read_catalog(str(path), encoding=f"{encoding}-le").products] == ["Tea"]


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(b"\xef\xbb\xbfindex,product,category\n1,Caf\xc3\xa9,Drinks\n2,\xff,Drinks\n")
    with pytest.raises(CatalogEncodingError, match=r": line 3, byte offset 43: 0xff is not valid utf-8; "):
        read_catalog(str(path))
    path.write_bytes(b"\xef\xbb\xbfindex,product,category\n1,Caf\xc3\xa9,Drinks\n")
    assert read_catalog(str(path)).products == [Product("1", "Café", "", "Drinks", "")]


def test_a_taxonomy_file_that_is_not_utf_8_is_named(tmp_path):
    path = tmp_path / "taxonomy.txt"
    path.write_bytes(b"1 - Animals\n2 - Caf\xe9\n")
    with pytest.raises(CatalogEncodingError) as info:
        read_taxonomy_file(str(path), 1)
    assert str(info.value) == (f"{path}: line 2, byte offset 19: 0xe9 is not valid utf-8; convert the file to "
                               "UTF-8 (iconv -f LATIN1 -t UTF-8 in.txt > out.txt)")


@pytest.mark.parametrize("text, message", [
    ("", "the file is empty"),
    ("\n1,Tea,Drinks\n", "line 1, the header row, is blank"),
    ("index,product,brand,description,category\n", "the file has no rows, only a header"),
])
def test_an_empty_or_header_only_catalog_is_said_to_be_so(tmp_path, text, message):
    path = tmp_path / "c.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_catalog(str(path))
    assert str(info.value) == f"{path}: {message}"


def test_no_label_anywhere_says_to_name_a_taxonomy_file(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("index,product,brand,description,category\n1,Tea,X,,\n")
    with pytest.raises(ValueError, match=r"holds no label in any row; name a taxonomy file"):
        read_catalog(str(path))


def test_zero_shot_jobs_per_product():
    spec = JobSpec(domain={"shop": "a tea shop"})
    product = Product("42", "Green Tea", "Leafy", "Beverages", "x" * 400)
    catalog = Catalog("c.csv", [product], ["Beverages", "Snacks"], {"Beverages": ["Tea", "Coffee"]}, spec=spec)
    classify, describe = product_requests(product, catalog)
    header = "Products of a tea shop and their categories.\n\n"
    assert classify_header(spec) == header
    assert classify.custom_id == "42/category" and describe.custom_id == "42/description"
    assert classify.labels == ["Beverages", "Snacks"]
    assert classify.prompt == header + "Product: Green Tea\nCategory:"
    assert classify.system_prompt is None
    assert classify.label_texts == [" Beverages (Tea, Coffee)\n", " Snacks\n"]
    assert classify.engine_calibration_prompt() == header + "Product: N/A\nCategory:"
    assert describe.prompt == ("Product: Green Tea\nBrand: Leafy\nListing: " + "x" * 400 + "\n\nWrite one full "
                              "sentence, not a title, that tells a shopper what this product is and why they would "
                              "want it, using only facts from the listing.")
    assert describe.system_prompt == DESCRIBE_SYSTEM_PROMPT.format(shop="a tea shop")
    assert "grocery" not in describe.system_prompt
    assert (describe.temperature, describe.max_tokens) == (0.0, 96)
    # the spec's other sampling fields reach the job as they are
    assert (describe.stop, describe.include_stop_str_in_output, describe.repetition_penalty) == (
        spec.describe.sampling["stop"], True, 1.2)
    assert classify.metadata == describe.metadata == {"product_id": "42"}
    key = os.path.abspath("c.csv")
    fields = ["category", "description"]
    assert enrichment_of(classify) == Enrichment(catalog=key, product_id="42", product_fields=fields)
    # a flagged description is written once more with the spec's retry sampling; its listing is
    # what the description is checked against
    assert enrichment_of(describe) == Enrichment(
        catalog=key, product_id="42", retry_sampling={"repetition_penalty": 1.1, "frequency_penalty": 0.3},
        listing=Listing(name="Green Tea", brand="Leafy", description="x" * 400, category="Beverages"),
        product_fields=fields)


def test_exemplar_jobs_show_the_nearest_labelled_products_never_the_product():
    products = [Product("1", "Green Tea Bags", "Leafy", "Beverages", ""),
                Product("2", "Green Tea Bags", "Leafy", "Beverages", ""),  # its duplicate title
                Product("3", "Green Tea Leaves", "Leafy", "Beverages", ""),
                Product("4", "Potato Chips", "Crunch", "Snacks", "")]
    pool = [Labelled(p.product_id, p.name, p.brand, p.category) for p in products]
    catalog = Catalog("c.csv", products, ["Beverages", "Snacks"], {"Beverages": ["Tea"]}, pool,
                      JobSpec(classify={"num_exemplars": 2}))
    classify, _ = product_requests(products[0], catalog, ExemplarIndex(pool))
    assert classify.prompt == (
        "Products of an online shop and their categories.\n\n"
        "Product: Potato Chips\nCategory: Snacks\n\n"
        "Product: Green Tea Leaves\nCategory: Beverages\n\n"
        "Product: Green Tea Bags\nCategory:")
    assert classify.label_texts == [" Beverages\n", " Snacks\n"]
    assert classify.calibration_prompt is None
    assert len(catalog_requests(catalog)) == 8


def test_description_prompt_leaves_out_an_empty_brand():
    catalog = Catalog("c.csv", [], ["x"])
    _, describe = product_requests(Product("7", "Wall Clock", "", "", ""), catalog)
    assert describe.prompt == ("Product: Wall Clock\n\nWrite one full sentence, not a title, that tells a shopper "
                              "what this product is and why they would want it, using only facts from the listing.")


def test_describe_system_prompt_has_at_least_60_tokens(tiny_model_dir):
    checker = PromptChecker.for_model(tiny_model_dir)
    assert len(checker.encode(DESCRIBE_SYSTEM_PROMPT.format(shop="an online shop"))) >= 60


def result(kind, status, product_id, label=None, prompt=0, cached=0, completion=0, text=None, field=None,
           parsed=None, finish_reason=None):
    """A row as Client.results gives it, with the catalog's annotation."""
    row = {"kind": kind, "status": status, "label": label, "output_text": text, "num_prompt_tokens": prompt,
           "num_cached_tokens": cached, "num_completion_tokens": completion,
           "metadata": {"product_id": product_id}, "parsed": parsed, "finish_reason": finish_reason,
           "extensions": {"enrichment": {"catalog": "c", "product_id": product_id, "field": field}}}
    return annotated(row)


def annotated(row):
    """``row`` with ``annotations`` as Client.results computes them from the rest of the row."""
    annotation = annotate_result(row)
    row["annotations"] = {} if annotation is None else {"enrichment": annotation}
    return row


def test_a_spec_with_extract_fields_adds_an_attribute_job():
    spec = load_spec("bigbasket")
    product = Product("42", "Dove Soap 3 x 100 g", "Dove", "Beauty", "  Gentle   soap " + "x" * 500)
    catalog = Catalog("c.csv", [product], ["Beauty"], spec=spec)
    classify, describe, extract = product_requests(product, catalog)
    assert extract.custom_id == "42/attributes"
    assert enrichment_of(extract) == Enrichment(
        catalog=os.path.abspath("c.csv"), product_id="42", field="attributes", listing=listing_of(product),
        example_values={"brand": ["Acme", "Zorro"], "quantity": [750], "unit": ["ml"], "pack_size": [2]},
        field_evidence={"brand": "brand", "pack_size": "count"},
        product_fields=["category", "description", "attributes"])
    assert extract.structured_outputs == {"json": spec.extract.schema, "disable_any_whitespace": True}
    assert extract.wants_json and (extract.temperature, extract.max_tokens) == (0.0, 128)
    system, example, answer, _, _, listing = extract.prompt
    assert [m.role for m in extract.prompt] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert system.content.endswith("Fields: brand, quantity, unit, pack_size.")
    assert "an Indian online grocery and household store" in system.content
    assert answer.content == '{"brand": "Acme", "quantity": 750, "unit": "ml", "pack_size": 2}'
    assert listing.content == "Product: Dove Soap 3 x 100 g\nDescription: Gentle soap " + "x" * 388
    # the default spec extracts nothing
    assert len(product_requests(product, dataclasses.replace(catalog, spec=JobSpec()))) == 2


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
        result("generate", "succeeded", "1", prompt=50, cached=0, completion=10, text="A fine tea."),
        result("generate", "succeeded", "2", prompt=50, cached=40, completion=30, text="A fine tea from"),
        result("generate", "succeeded", "1", field="attributes", parsed={"brand": "b"}, finish_reason="stop"),
        result("generate", "succeeded", "2", field="attributes", text='{"bra', finish_reason="length"),
        result("generate", "failed", "3", field="attributes"),
    ]
    summary = summarize(catalog, results, wall_s=2.0)
    assert (summary.num_products, summary.num_succeeded, summary.num_failed) == (4, 7, 2)
    assert (summary.num_generated_tokens, summary.generated_tokens_per_s) == (40, 20.0)
    assert summary.prefix_cache_hit_rate == pytest.approx(200 / 400)
    assert (summary.num_classified, summary.accuracy) == (3, pytest.approx(2 / 3))
    assert (summary.majority_label, summary.majority_baseline) == ("Tea", pytest.approx(2 / 3))
    text = summary.format()
    assert "7 succeeded, 2 failed" in text and "66.7 %" in text and "20.0 tokens/s" in text
    assert (summary.num_described, summary.description_quality, summary.clean_rate) == (2, {"ok": 1, "unfinished": 1}, 0.5)
    assert "descriptions clean:  50.0 % of 2 (ok 1, unfinished 1)" in text
    assert (summary.num_extracted, summary.num_attributes_valid, summary.num_attributes_cut) == (2, 1, 1)
    assert "attributes:          1 of 2 extracted valid (1 cut by max_tokens)" in text


def test_summary_sets_the_nearest_neighbour_vote_beside_the_majority_baseline():
    pool = [Labelled("p1", "Green Tea Leaves", "", "Tea"), Labelled("p2", "Black Tea Bags", "", "Tea"),
            Labelled("p3", "Neem Soap Bar", "", "Soap"), Labelled("p4", "Rose Soap Bar", "", "Soap")]
    products = [Product("1", "Green Tea", "", "Tea", ""), Product("2", "Lemon Tea", "", "Soap", ""),
                Product("3", "Neem Soap", "", "Soap", ""), Product("4", "Lime Soap", "", "Soap", "")]
    catalog = Catalog("c.csv", products, ["Soap", "Tea"], pool=pool, spec=JobSpec())
    # the model is right on 1 and 2 (its truth is Soap); 4 never classified: the vote leaves it out too
    results = [result("classify", "succeeded", "1", "Tea"), result("classify", "succeeded", "2", "Soap"),
               result("classify", "succeeded", "3", "Tea"), result("classify", "failed", "4")]
    summary = summarize(catalog, results, wall_s=1.0)
    # the vote: 1 -> Tea (right), 2 -> Tea (wrong), 3 -> Soap (right)
    assert summary.neighbour_vote_accuracy == pytest.approx(2 / 3)
    lines = summary.format().splitlines()
    assert lines[5:7] == [
        "category accuracy:   66.7 % over 3 products (majority baseline 66.7 %: Soap; nearest-neighbour vote, "
        "no model: 66.7 %)",
        "categories chosen:   the model scores each label after a prompt that shows the product's 4 nearest "
        "labelled products of the same catalog (TF-IDF of name and brand) with their categories"]
    zero_shot = dataclasses.replace(catalog, spec=JobSpec(classify={"method": "zero_shot"}))
    assert summarize(zero_shot, results, wall_s=1.0).format().splitlines()[6] == (
        'categories chosen:   the model scores each label, with its commonest sub-labels, calibrated against "N/A"; '
        "no examples")


def test_summary_counts_cancelled_jobs():
    catalog = Catalog("c.csv", [Product("1", "a", "b", "Tea", "")], ["Tea"])
    summary = summarize(catalog, [result("classify", "cancelled", "1"), result("generate", "succeeded", "1", text="A.")],
                        wall_s=1.0)
    assert (summary.num_succeeded, summary.num_failed, summary.num_cancelled) == (1, 0, 1)
    assert "jobs:                1 succeeded, 0 failed, 1 cancelled" in summary.format()


def test_summary_of_nothing():
    summary = summarize(Catalog("c.csv", [], ["x"]), [], wall_s=0.0)
    assert (summary.accuracy, summary.prefix_cache_hit_rate, summary.generated_tokens_per_s) == (None, None, None)
    assert "n/a" in summary.format()


def test_summary_counts_decisions_per_field_with_the_top_reasons():
    catalog = Catalog("c.csv", [Product(p, "Green Tea", "Leafy", "Tea", "") for p in "123"], ["Tea"])
    listing = {"name": "Green Tea", "brand": "Leafy", "description": "", "category": "Tea"}

    def marked(row, **more):
        row["extensions"]["enrichment"].update(listing=listing, product_fields=["category", "description"], **more)
        return annotated(row)

    results = [marked(result("classify", "succeeded", p, "Tea")) for p in "123"] + [
        marked(result("generate", "succeeded", "1", text="A Leafy green tea.")),
        marked(result("generate", "succeeded", "2", text="A fresh green tea from")),
        marked(result("generate", "succeeded", "3", text="Made in Italy and Spain, this tea is 100% pure.")),
    ]
    summary = summarize(catalog, results, wall_s=1.0)
    assert summary.decisions == {"category": {"auto": 3}, "description": {"auto": 1, "reject": 1, "review": 1}}
    assert summary.reasons == {"category": [], "description": [
        ("unfinished", 1), ("unsupported_number", 1), ("unsupported_place", 1)]}
    assert summary.num_publishable == 1
    assert summary.format().splitlines()[-3:] == [
        "category:            3 auto, 0 review, 0 reject",
        "description:         1 auto, 1 review, 1 reject; top reasons: unfinished 1, unsupported_number 1, "
        "unsupported_place 1",
        "publishable:         1 of 3 products (every field auto)",
    ]
