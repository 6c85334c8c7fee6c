"""Incremental enrichment: a product whose content, job spec and model are unchanged since its
last enrichment is skipped; changed, new and unfinished ones are enriched (exact plans)."""

import dataclasses


from tests import support
from weir.jobs.catalog import store as catalog_store
from weir.jobs.catalog.enrichment import (
    Catalog, Product, catalog_requests, plan_enrichment, product_fingerprint, spec_version,
)
from weir.jobs.catalog.marker import enrichment_of
from weir.jobs.catalog.spec import JobSpec, load_spec
from weir.jobs.db import JobKind, JobStatus
from weir.jobs.results import JobResult

MODEL = "tiny"


def catalog_of(products, spec=JobSpec(), path="/data/shop.csv"):
    return Catalog(path, products, ["Tea", "Soap"], spec=spec)


def products(n=50):
    return [Product(str(i), f"Product {i}", "Brand", "Tea" if i % 2 else "Soap", f"Description {i}.") for i in range(n)]


def run_jobs(session_factory, catalog, plan, only=None):
    """Store the plan's batch and succeed its jobs (those whose custom_id is in ``only``, when
    given), as the worker would; returns the number of jobs the batch holds."""
    requests = catalog_requests(catalog, plan)
    with session_factory.begin() as session:
        batch, jobs = support.create_batch(session, requests, model=MODEL)
    for job in jobs:
        if only is not None and job.custom_id not in only:
            continue
        with session_factory.begin() as session:
            claimed = support.claim_job(session, job.id)
        if job.kind == JobKind.CLASSIFY:
            result = JobResult(status=JobStatus.SUCCEEDED, label="Tea", label_probs={"Tea": 0.6, "Soap": 0.4})
        else:
            result = JobResult(status=JobStatus.SUCCEEDED, output_text="A fine product.", finish_reason="stop")
        with session_factory.begin() as session:
            if support.record_result(session, claimed, result):
                catalog_store.record_enrichment(session, claimed, result, model=MODEL)
    return len(jobs)


def counts(plan):
    """(enriched, new, changed, unchanged); unfinished ones are ``plan.num_unfinished``."""
    return len(plan.todo), plan.num_new, plan.num_changed, plan.num_unchanged


def test_a_second_run_enriches_only_the_three_changed_products(session_factory):
    catalog = catalog_of(products())
    first = plan_enrichment(session_factory, catalog, MODEL)
    assert counts(first) == (50, 50, 0, 0)
    assert run_jobs(session_factory, catalog, first) == 100
    assert counts(plan_enrichment(session_factory, catalog, MODEL)) == (0, 0, 0, 50)

    edited = products()
    edited[3] = dataclasses.replace(edited[3], name="Product 3, new recipe")
    edited[17] = dataclasses.replace(edited[17], description="Now in a bigger pack.")
    edited[40] = dataclasses.replace(edited[40], brand="Other")
    changed = catalog_of(edited)
    plan = plan_enrichment(session_factory, changed, MODEL)
    assert counts(plan) == (3, 0, 3, 47)
    assert [p.product_id for p in plan.todo] == ["3", "17", "40"]
    requests = catalog_requests(changed, plan)
    assert [r.custom_id for r in requests] == [
        "3/category", "3/description", "17/category", "17/description", "40/category", "40/description"]
    assert {enrichment_of(r).fingerprint for r in requests[:2]} == {product_fingerprint(edited[3], JobSpec(), MODEL)}

    # the run stops part way: product 3 finished, 17 only classified, 40 not started
    assert run_jobs(session_factory, changed, plan, only={"3/category", "3/description", "17/category"}) == 6
    resumed = plan_enrichment(session_factory, changed, MODEL)
    assert [p.product_id for p in resumed.todo] == ["17", "40"] and counts(resumed) == (2, 0, 2, 48)
    assert resumed.num_unfinished == 0  # 17's description was made from its old content: changed


def test_a_new_spec_or_model_redoes_every_product_and_full_redoes_all(session_factory):
    path = "/data/shop-2.csv"
    catalog = catalog_of(products(6), path=path)
    run_jobs(session_factory, catalog, plan_enrichment(session_factory, catalog, MODEL))
    assert counts(plan_enrichment(session_factory, catalog, MODEL)) == (0, 0, 0, 6)
    assert counts(plan_enrichment(session_factory, catalog, "another-model")) == (6, 0, 6, 0)
    other_spec = JobSpec(domain={"shop": "a tea shop"})
    assert counts(plan_enrichment(session_factory, catalog_of(products(6), other_spec, path), MODEL)) == (6, 0, 6, 0)
    full = plan_enrichment(session_factory, catalog, MODEL, full=True)
    assert counts(full) == (6, 0, 0, 6) and full.full
    # a spec that also extracts attributes is another spec: all are redone
    extracting = catalog_of(products(6), load_spec("bigbasket").model_copy(
        update={"columns": JobSpec().columns, "classify": JobSpec().classify}), path)  # no pool here to vote
    plan = plan_enrichment(session_factory, extracting, MODEL)
    assert plan.num_unchanged == 0
    # its attribute jobs never finish: those products are not done yet
    run_jobs(session_factory, extracting, plan, only={f"{i}/{f}" for i in range(6) for f in ("category", "description")})
    unfinished = plan_enrichment(session_factory, extracting, MODEL)
    assert counts(unfinished) == (6, 0, 0, 0) and unfinished.num_unfinished == 6
    run_jobs(session_factory, extracting, plan_enrichment(session_factory, extracting, MODEL),
             only={f"{i}/attributes" for i in range(6)})
    assert counts(plan_enrichment(session_factory, extracting, MODEL)) == (0, 0, 0, 6)
    # another catalog's rows never count
    elsewhere = catalog_of(products(6), path="/data/other.csv")
    assert counts(plan_enrichment(session_factory, elsewhere, MODEL)) == (6, 6, 0, 0)


def test_the_spec_version_of_the_shipped_specs_is_stable():
    """A stored fingerprint holds the spec version: if it changed, every product would be enriched
    again after an upgrade that changed no prompt. (Changed on purpose with the description prompt
    that shows the listing and the extraction's log-probabilities, and for the shipped specs with
    the hybrid category method; the default spec's did not change with it.)"""
    assert [spec_version(s) for s in (JobSpec(), load_spec("flipkart"), load_spec("bigbasket"))] == [
        "f0923528b9641e73", "a298093252894864", "8ba01b04ef8741f6"]
