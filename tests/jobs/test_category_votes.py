"""Categories by the nearest-neighbour vote inside the catalog job (``[classify] method`` ``knn``
and ``hybrid``): which products get a classification job, what the vote stores, and the summary."""

import dataclasses
import uuid

import pytest
from sqlalchemy import select, text

from tests import support
from weir.jobs.catalog.enrichment import (
    Catalog, Product, Vote, catalog_key, catalog_requests, category_votes, enqueue_catalog, spec_version, summarize,
)
from weir.jobs.catalog.exemplars import Labelled
from weir.jobs.catalog.spec import VOTE_METHODS, JobSpec, SpecError, parse_spec
from weir.jobs.catalog.store import record_votes
from weir.jobs.catalog.tables import ProductEnrichment
from weir.jobs.db import Job, JobKind

POOL = [Labelled("p1", "Green Tea Leaves", "", "Tea"), Labelled("p2", "Green Tea Bags", "", "Tea"),
        Labelled("p3", "Lavender Bath Soap", "", "Soap"), Labelled("p4", "Lavender Soap Bar", "", "Soap")]
# two nearest: both Tea (share 1); both Soap (share 1); one of each (Soap slightly nearer: a wrong,
# unsure vote, share 0.51)
PRODUCTS = [Product("a", "Green Tea Pack", "", "Tea", ""), Product("b", "Lavender Soap Pack", "", "Soap", ""),
            Product("c", "Lavender Green Tea", "", "Tea", "")]


def catalog_with(method, **classify):
    """A catalog of ``PRODUCTS`` voted by 2 neighbours from ``POOL``, at a path no other test uses."""
    voters = {"num_neighbours": 2} if method in VOTE_METHODS else {}
    spec = parse_spec({"classify": {"method": method, **voters, **classify}})
    return Catalog(f"/data/votes-{uuid.uuid4().hex}.csv", PRODUCTS, ["Soap", "Tea"], pool=POOL, spec=spec)


def kinds(requests):
    return [(r.custom_id, type(r).__name__) for r in requests]


def test_knn_votes_every_product_and_no_classification_job_runs():
    catalog = catalog_with("knn", vote_threshold=0.9)
    votes = category_votes(catalog, catalog.products)
    assert [(v.product_id, v.label) for v in votes.values()] == [("a", "Tea"), ("b", "Soap"), ("c", "Soap")]
    assert votes["a"].share == votes["b"].share == 1.0
    assert round(votes["c"].share, 2) == 0.51
    assert kinds(catalog_requests(catalog)) == [
        ("a/description", "GenerateRequest"), ("b/description", "GenerateRequest"), ("c/description", "GenerateRequest")]


def test_hybrid_leaves_the_unsure_vote_to_the_model_with_exemplars():
    catalog = catalog_with("hybrid", vote_threshold=0.9)
    votes = category_votes(catalog, catalog.products)
    assert sorted(votes) == ["a", "b"]
    requests = catalog_requests(catalog)
    assert kinds(requests) == [("a/description", "GenerateRequest"), ("b/description", "GenerateRequest"),
                               ("c/category", "ClassifyRequest"), ("c/description", "GenerateRequest")]
    assert "Product: Green Tea Bags\nCategory: Tea" in requests[2].prompt  # the exemplars' lines
    # the model's methods never vote
    assert category_votes(catalog_with("exemplars"), PRODUCTS) == {}


def test_a_vote_method_needs_a_threshold_for_hybrid_and_labelled_products():
    with pytest.raises(SpecError, match=r'\[classify\] method = "hybrid" needs vote_threshold above 0'):
        parse_spec({"classify": {"method": "hybrid"}})
    with pytest.raises(SpecError, match=r"\[classify\] method = 'knn' needs labelled products to vote"):
        parse_spec({"classify": {"method": "knn"}, "taxonomy": {"source": "file", "file": "t.txt"}})
    unlabelled = dataclasses.replace(catalog_with("knn"), pool=[])
    with pytest.raises(ValueError, match="method = 'knn' needs labelled products; none has a 'category'"):
        category_votes(unlabelled, PRODUCTS)


def test_only_what_shapes_the_outputs_changes_the_spec_version():
    knn = parse_spec({"classify": {"method": "knn", "vote_threshold": 0.5}})
    hybrid = parse_spec({"classify": {"method": "hybrid", "vote_threshold": 0.5}})
    # knn: the threshold only decides auto/review; the model's methods read neither vote key
    assert spec_version(knn) == spec_version(knn.model_copy(update={"classify": knn.classify.model_copy(
        update={"vote_threshold": 0.9})}))
    assert spec_version(JobSpec()) == spec_version(JobSpec().model_copy(update={"classify": JobSpec().classify.model_copy(
        update={"num_neighbours": 3, "vote_threshold": 0.4})}))
    # hybrid: the threshold says which products the model classifies
    assert spec_version(hybrid) != spec_version(hybrid.model_copy(update={"classify": hybrid.classify.model_copy(
        update={"vote_threshold": 0.9})}))
    assert spec_version(knn.model_copy(update={"classify": knn.classify.model_copy(update={"num_neighbours": 3})})) \
        != spec_version(knn)


def test_enqueue_stores_the_voted_categories_as_the_batch_s_and_classifies_only_the_rest(client):
    catalog = catalog_with("knn", vote_threshold=0.9)
    batch_id = enqueue_catalog(client, catalog)
    with client.session_factory() as session:
        jobs = session.execute(select(Job.custom_id, Job.kind).where(Job.batch_id == batch_id)
                               .order_by(Job.batch_index)).all()
        rows = session.execute(text(
            "SELECT product_id, category, category_method, category_decision, category_reasons, attributes_wanted, "
            "source_batch_id FROM product_enrichment WHERE catalog = :c ORDER BY product_id"),
            {"c": catalog_key(catalog)}).all()
        share_c = session.execute(select(ProductEnrichment.category_confidence)
                                  .where(ProductEnrichment.product_id == "c")).scalar_one()
    assert [(custom_id, kind) for custom_id, kind in jobs] == [
        ("a/description", JobKind.GENERATE), ("b/description", JobKind.GENERATE), ("c/description", JobKind.GENERATE)]
    low = f"{share_c:.2f}"
    assert low == "0.51"
    assert [tuple(r[:-1]) for r in rows] == [
        ("a", "Tea", "knn", "auto", [], False),
        ("b", "Soap", "knn", "auto", [], False),
        ("c", "Soap", "knn", "review", [{"code": "low_confidence", "text": "0.51"}], False),
    ]
    assert {r[-1] for r in rows} == {batch_id}


def test_an_older_batch_s_votes_never_overwrite_a_newer_batch_s_row(session_factory):
    from weir.jobs.schemas import GenerateRequest

    CATALOG = f"/votes-{uuid.uuid4().hex}.csv"

    with session_factory.begin() as session:
        older, _ = support.create_batch(session, [GenerateRequest(prompt="x")], model="tiny")
    with session_factory.begin() as session:
        newer, _ = support.create_batch(session, [GenerateRequest(prompt="x")], model="tiny")
    with session_factory.begin() as session:
        assert record_votes(session, CATALOG, [Vote("a", "Tea", 1.0)], newer.id, model="tiny") == {(CATALOG, "a")}
    with session_factory.begin() as session:
        assert record_votes(session, CATALOG, [Vote("a", "Soap", 1.0), Vote("b", "Soap", 0.4)], older.id,
                            model="tiny", review_below=0.5) == {(CATALOG, "b")}
    with session_factory() as session:
        rows = session.execute(text("SELECT product_id, category, category_decision FROM product_enrichment "
                                    "WHERE catalog = :c ORDER BY product_id"), {"c": CATALOG}).all()
    assert [tuple(r) for r in rows] == [("a", "Tea", "auto"), ("b", "Soap", "review")]


def test_the_summary_counts_voted_categories_beside_the_model_s():
    hybrid = catalog_with("hybrid", vote_threshold=0.9)
    summary = summarize(hybrid, [], wall_s=1.0, votes=category_votes(hybrid, PRODUCTS))
    assert (summary.num_classified, summary.accuracy, summary.decisions) == (2, 1.0, {"category": {"auto": 2}})
    assert summary.format().splitlines()[6] == (
        "categories chosen:   the vote of the product's 2 nearest labelled products (TF-IDF of name and brand) where "
        "its share is at least 0.9; elsewhere the model scores each label after a prompt that shows the product's 4 "
        "nearest labelled products of the same catalog (TF-IDF of name and brand) with their categories")
    knn = catalog_with("knn", vote_threshold=0.9)
    summary = summarize(knn, [], wall_s=1.0, votes=category_votes(knn, PRODUCTS))
    assert (summary.num_classified, summary.decisions) == (3, {"category": {"auto": 2, "review": 1}})
    assert summary.format().splitlines()[5].startswith("category accuracy:   66.7 % over 3 products")
    assert summary.reasons == {"category": [("low_confidence", 1)]}


def test_the_summary_s_vote_baseline_is_the_knn_method_s_own_vote():
    """Under ``knn`` the baseline line and the category accuracy are one vote: a and b right, c
    wrong, and d, which no labelled product resembles (every similarity 0), has no category."""
    knn = catalog_with("knn", vote_threshold=0.9)
    products = PRODUCTS + [Product("d", "Qqq Zzz", "", "Tea", "")]
    knn = dataclasses.replace(knn, products=products)
    votes = category_votes(knn, products)
    assert votes["d"].label is None
    summary = summarize(knn, [], wall_s=1.0, votes=votes)
    assert summary.accuracy == summary.neighbour_vote_accuracy == 2 / 4
