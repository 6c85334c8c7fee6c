"""The grounding check and the decisions built on it: exact decisions and reasons for hand-written
listing and output pairs."""

import pytest

from weir.jobs.catalog.decisions import judge_attributes, judge_category, judge_description
from weir.jobs.catalog.grounding import Listing, quantities, singular, unsupported_claims

DUVET = Listing(name="Solid Cotton Duvet Cover - Double, Blue", brand="Spaces",
                description="A soft 100 percent cotton duvet cover in blue with a zip closure, 220 x 230 cm.",
                category="Home Furnishing")
DAL = Listing(name="Toor Dal / Arhar Dal 500g", brand="Tata Sampann",
              description="Unpolished toor dal, rich in protein. Pack of 2.", category="Foodgrains, Oil & Masala")
GARLIC = Listing(name="Garlic Oil - Vegetarian Capsule 500 mg", brand="Sri Sri Ayurveda",
                 description="This Product contains Garlic Oil that is known to help proper digestion.",
                 category="Beauty & Hygiene")


def describe(text, listing):
    return judge_description(text, listing).as_dict()


def test_wool_on_a_cotton_product_is_reviewed_as_an_unsupported_material():
    assert describe("This Spaces duvet cover is made with 100% wool.", DUVET) == {
        "field": "description", "decision": "review",
        "reasons": [{"code": "unsupported_material", "text": "wool"}]}


def test_a_pound_price_on_a_rupee_catalog_is_reviewed():
    assert describe("Get this Tata Sampann toor dal at just under £15!", DAL) == {
        "field": "description", "decision": "review",
        "reasons": [{"code": "unsupported_price", "text": "£15"}]}


def test_a_description_that_repeats_only_listing_facts_is_auto():
    assert describe("Tata Sampann unpolished toor dal comes in a 500 g pack of 2 and is rich in protein.", DAL) == {
        "field": "description", "decision": "auto", "reasons": []}
    assert describe("This Spaces cotton duvet cover in blue has a soft zip closure.", DUVET)["decision"] == "auto"


def test_a_loop_is_rejected_with_the_repeated_words():
    looped = "Garlic oil capsules help digestion and garlic oil capsules help digestion and garlic oil capsules help digestion."
    assert describe(looped, GARLIC) == {"field": "description", "decision": "reject",
                                        "reasons": [{"code": "repetitive", "text": "garlic oil capsules help"}]}


def test_unfinished_and_empty_text_are_rejected():
    assert describe("Sri Sri Ayurveda garlic oil capsules help", GARLIC) == {
        "field": "description", "decision": "reject",
        "reasons": [{"code": "unfinished", "text": "Sri Ayurveda garlic oil capsules help"}]}
    assert describe("  ", GARLIC) == {"field": "description", "decision": "reject", "reasons": [{"code": "empty"}]}


def test_invented_brands_places_numbers_units_and_colours_are_each_named():
    text = "Made in Italy by Raymond, this red duvet cover weighs 2 kg, costs Rs. 999 and lasts 220 days."
    assert unsupported_claims(text, DUVET) == [
        {"code": "unsupported_number", "text": "2 kg"},
        {"code": "unsupported_price", "text": "Rs. 999"},
        {"code": "unsupported_unit", "text": "220 days"},
        {"code": "unsupported_place", "text": "Italy"},
        {"code": "unsupported_name", "text": "Raymond"},
        {"code": "unsupported_colour", "text": "red"},
    ]


@pytest.mark.parametrize("text", [
    "Tata Sampann toor dal, 500g.", "Tata Sampann toor dal, 500 grams.", "Tata Sampann toor dal, 0.5 kg.",
    "Tata Sampann toor dals in packs of 2.",
])
def test_units_spacing_plurals_and_case_are_normalised(text):
    assert unsupported_claims(text, DAL) == []


def test_a_currency_the_listing_names_is_supported():
    priced = Listing(name="Tea 250 g", description="MRP Rs 120.")
    assert unsupported_claims("A 250 g tea for ₹120.", priced) == []
    assert unsupported_claims("A 250 g tea for $120.", priced) == [{"code": "unsupported_price", "text": "$120"}]
    assert unsupported_claims("Priced in dollars.", priced) == [{"code": "unsupported_currency", "text": "dollars"}]


def test_words_and_quantities_are_read_as_documented():
    assert [singular(w) for w in ("Berries", "boxes", "grams", "glass", "citrus", "gas")] == [
        "berry", "box", "gram", "glass", "citrus", "gas"]
    assert [(q.value, q.dimension, q.base, q.currency, q.text) for q in quantities("1,000 ml for £1.50 and 5kg")] == [
        (1000.0, "volume", 1000.0, None, "1,000 ml"), (1.5, None, None, "GBP", "£1.50"),
        (5.0, "mass", 5000.0, None, "5kg")]


EXAMPLES = {"brand": ["Acme"], "quantity": [750], "unit": ["ml"], "pack_size": [2]}


def test_attributes_the_listing_holds_are_auto_and_nulls_are_never_a_reason():
    assert judge_attributes({"brand": "Tata Sampann", "quantity": 500, "unit": "g", "pack_size": 2}, "stop", DAL,
                            EXAMPLES).as_dict() == {"field": "attributes", "decision": "auto", "reasons": []}
    assert judge_attributes({"brand": None, "quantity": None, "unit": None, "pack_size": None}, "stop", DAL,
                            EXAMPLES).decision == "auto"


def test_a_value_copied_from_the_worked_example_is_never_auto():
    assert judge_attributes({"brand": "Acme", "quantity": 750, "unit": "ml", "pack_size": 2}, "stop", DAL,
                            EXAMPLES).as_dict() == {
        "field": "attributes", "decision": "review", "reasons": [
            {"code": "example_value", "field": "brand", "text": "Acme"},
            {"code": "example_value", "field": "quantity", "text": "750"},
            {"code": "example_value", "field": "unit", "text": "ml"}]}


def test_a_value_the_listing_does_not_hold_is_reviewed():
    assert judge_attributes({"brand": "Tata", "quantity": 1000, "unit": "kg", "pack_size": None}, "stop", DAL,
                            EXAMPLES).as_dict() == {
        "field": "attributes", "decision": "review", "reasons": [
            {"code": "unsupported_value", "field": "quantity", "text": "1000"},
            {"code": "unsupported_value", "field": "unit", "text": "kg"}]}


def test_an_extraction_cut_by_max_tokens_is_rejected():
    assert judge_attributes(None, "length", DAL, EXAMPLES).as_dict() == {
        "field": "attributes", "decision": "reject", "reasons": [{"code": "cut_by_max_tokens"}]}
    # even had the cut text parsed
    assert judge_attributes({"brand": "Tata Sampann"}, "length", DAL).decision == "reject"


def test_without_a_listing_nothing_is_auto_and_a_category_is():
    assert judge_description("A fine product.", None).as_dict() == {
        "field": "description", "decision": "review", "reasons": [{"code": "no_listing"}]}
    assert judge_attributes({"brand": "X"}, "stop", None).decision == "review"
    assert judge_category("Tea").as_dict() == {"field": "category", "decision": "auto", "reasons": []}


def test_a_claim_the_listing_does_not_make_and_a_text_about_something_else_are_reviewed():
    assert describe("This Sri Sri Ayurveda garlic oil is clinically proven to boost immunity.", GARLIC) == {
        "field": "description", "decision": "review", "reasons": [
            {"code": "unsupported_claim", "text": "clinically"}, {"code": "unsupported_claim", "text": "proven"},
            {"code": "unsupported_claim", "text": "immunity"}, {"code": "unlisted_words", "text": "boost"}]}
    assert describe("Sounds like a wonderful idea!", GARLIC) == {
        "field": "description", "decision": "review", "reasons": [
            {"code": "not_about_product"}, {"code": "unlisted_words", "text": "sound, idea"}]}


def position(token, logprob):
    return [{"token_id": 0, "logprob": logprob, "rank": 1, "decoded_token": token}]


def test_each_values_confidence_is_the_probability_of_its_tokens():
    import math

    from weir.jobs.catalog.decisions import attribute_confidence

    # {"brand": "Tata", "unit": "g", "pack_size": null}, as the tokens came
    tokens = [('{"', 0.0), ('brand', 0.0), ('":', 0.0), (' "', 0.0), ('T', math.log(0.5)), ('ata', math.log(0.8)),
              ('",', 0.0), (' "unit', 0.0), ('":', 0.0), (' "g', math.log(0.25)), ('",', 0.0), (' "pack_size', 0.0),
              ('":', 0.0), (' null', math.log(0.9)), ('}', 0.0)]
    completions = [{"logprobs": [position(t, lp) for t, lp in tokens]}]
    parsed = {"brand": "Tata", "unit": "g", "pack_size": None}
    assert attribute_confidence(parsed, completions) == {"brand": 0.4, "unit": 0.25}
    assert attribute_confidence(parsed, [{"logprobs": None}]) is None
    assert attribute_confidence(None, completions) is None


LEGGINGS = Listing(name="Zero Baby Girl's Grey Leggings", brand="Zero",
                   description="Specifications of Zero Baby Girl's Leggings (Pack of 3) Fabric Cotton Ideal For Baby Girl's",
                   category="Clothing")
KINDS = {"brand": "brand", "type": "none", "color": "colour", "material": "material", "ideal_for": "audience",
         "pack_of": "count"}


def attributes(values):
    return judge_attributes(values, "stop", LEGGINGS, None, KINDS).as_dict()


def test_values_that_pass_their_fields_evidence_kind_are_auto():
    assert attributes({"brand": "Zero", "type": None, "color": "Grey", "material": "Cotton",
                       "ideal_for": "Baby Girls", "pack_of": 3}) == {
        "field": "attributes", "decision": "auto", "reasons": []}


def test_a_title_phrase_in_a_field_of_another_kind_is_reviewed():
    assert attributes({"brand": "Leggings", "type": "Leggings", "color": "Baby Girl", "material": "Grey",
                       "ideal_for": "Leggings", "pack_of": 1}) == {
        "field": "attributes", "decision": "review", "reasons": [
            {"code": "differs_from_listing", "field": "brand", "text": "Leggings"},
            {"code": "unverifiable", "field": "type", "text": "Leggings"},
            {"code": "outside_vocabulary", "field": "color", "text": "Baby Girl"},
            {"code": "outside_vocabulary", "field": "material", "text": "Grey"},
            {"code": "outside_vocabulary", "field": "ideal_for", "text": "Leggings"},
            {"code": "unsupported_count", "field": "pack_of", "text": "1"}]}


def test_a_vocabulary_value_the_listing_does_not_hold_is_unsupported_and_an_example_one_says_so():
    assert judge_attributes({"color": "Blue", "material": "Silk", "ideal_for": "Men"}, "stop", LEGGINGS,
                            {"color": ["Blue"]}, KINDS).as_dict()["reasons"] == [
        {"code": "example_value", "field": "color", "text": "Blue"},
        {"code": "unsupported_value", "field": "material", "text": "Silk"},
        {"code": "unsupported_value", "field": "ideal_for", "text": "Men"}]


def test_a_material_the_listing_holds_beside_another_material_is_reviewed():
    frame = Listing(name="Wood Photo Frame", description="Aluminium frame with a glass front, wood finish")
    assert judge_attributes({"material": "Wood"}, "stop", frame, None, KINDS).as_dict()["reasons"] == [
        {"code": "several_in_listing", "field": "material", "text": "Wood"}]
    assert judge_attributes({"material": "Aluminium, Glass and Wood"}, "stop", frame, None, KINDS).decision == "auto"
    assert judge_attributes({"material": "Cotton"}, "stop", LEGGINGS, None, KINDS).decision == "auto"  # the only one


def test_a_brand_is_checked_against_the_listings_own_brand_only_when_it_has_one():
    no_brand = Listing(name="Zero Baby Girl's Grey Leggings", category="Clothing")
    assert judge_attributes({"brand": "Zero Baby"}, "stop", no_brand, None, KINDS).decision == "auto"
    assert judge_attributes({"brand": "Zero Baby"}, "stop", LEGGINGS, None, KINDS).decision == "auto"
    assert judge_attributes({"brand": "Baby"}, "stop", LEGGINGS, None, KINDS).decision == "review"
    assert judge_attributes({"brand": "Baby"}, "stop", no_brand, None, KINDS).decision == "auto"


@pytest.mark.parametrize("text, count, ok", [
    ("Pack of 3", 3, True), ("set of 6 napkins", 6, True), ("2 pcs", 2, True), ("10-pack", 10, True),
    ("Pack of 3", 2, False), ("13 pcs", 3, False), ("3 kg", 3, False), ("Pack of 3", True, False)])
def test_a_count_must_be_stated_as_a_count(text, count, ok):
    listing = Listing(name="Napkins", description=text)
    decision = judge_attributes({"pack_of": count}, "stop", listing, None, {"pack_of": "count"}).decision
    assert decision == ("auto" if ok else "review")


def test_a_category_below_the_specs_probability_is_reviewed():
    assert judge_category("Tea", 0.99, 0.995).as_dict() == {
        "field": "category", "decision": "review", "reasons": [{"code": "low_confidence", "text": "0.99"}]}
    assert judge_category("Tea", 0.995, 0.995).decision == "auto"
    assert judge_category("Tea", 0.2, None).decision == "auto"
    assert judge_category("Tea", None, 0.995).decision == "auto"  # no probability stored: nothing to compare
    assert judge_category(None, 0.99, 0.5).decision == "reject"


def test_the_classification_job_carries_its_specs_review_threshold(tmp_path):
    from weir.jobs.catalog.decisions import judge
    from weir.jobs.catalog.enrichment import catalog_requests, read_catalog
    from weir.jobs.catalog.marker import enrichment_of
    from weir.jobs.catalog.spec import parse_spec

    path = tmp_path / "c.csv"
    path.write_text("index,product,category,brand,description\r\n1,Green Tea,Tea,Tetley,d\r\n2,Black Tea,Tea,Tata,d\r\n")
    request = catalog_requests(read_catalog(str(path), parse_spec({"classify": {"review_below": 0.9}})))[0]
    mark = enrichment_of(request)
    assert request.kind == "classify" and mark.review_below == 0.9
    assert judge(mark, is_classification=True, label="Tea", label_probs={"Tea": 0.8}).decision == "review"
    assert judge(mark, is_classification=True, label="Tea", label_probs={"Tea": 0.95}).decision == "auto"
    default = catalog_requests(read_catalog(str(path), parse_spec({})))[0]
    assert enrichment_of(default).review_below is None


def test_content_words_the_listing_does_not_hold_are_found_case_plural_and_suffix_aside():
    from weir.jobs.catalog.grounding import unlisted_words

    assert unlisted_words("The stylish Toor Dals offer a perfect, protein-rich meal every day.", DAL) == []
    assert unlisted_words("Tata Sampann toor dal, made entirely from pure onion seeds.", DAL) == ["onion", "seed"]
    assert unlisted_words("This Spaces duvet cover, designed with zips, was sold in 2 cities.", DUVET) == [
        "sold", "city"]


def test_an_unlisted_word_sends_a_description_to_review():
    assert describe("The Tata Sampann toor dal, a perfect protein-rich meal.", DAL)["decision"] == "auto"
    assert describe("The Tata Sampann toor dal, a perfect snack.", DAL) == {
        "field": "description", "decision": "review", "reasons": [{"code": "unlisted_words", "text": "snack"}]}
    assert describe("The Tata Sampann toor dal, a perfect snack for hikers.", DAL) == {
        "field": "description", "decision": "review", "reasons": [{"code": "unlisted_words", "text": "snack, hiker"}]}
