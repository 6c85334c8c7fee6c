"""An enrichment's decisions are stored with its row, and ``latest_enrichment.publishable`` follows
them: every field the spec asks for must be ``auto``."""

import json

from sqlalchemy import text

from tests import support
from weir.jobs.catalog import store as catalog_store
from weir.jobs.catalog.enrichment import catalog_key, catalog_requests, read_catalog
from weir.jobs.catalog.spec import parse_spec
from weir.jobs.db import JobStatus
from weir.jobs.results import JobResult

CSV = ("index,product,category,brand,description\r\n"
       "1,Cotton Duvet Cover,Home,Spaces,A soft cotton duvet cover in blue.\r\n"
       "2,Cotton Bath Towel,Home,Spaces,A thick cotton towel.\r\n"
       "3,Steel Bottle,Kitchen,Milton,A steel bottle.\r\n")
SPEC = {"extract": {"fields": {"brand": {"type": "string"}, "color": {"type": "string"}}}}


def run(session_factory, job, result):
    with session_factory.begin() as session:
        claimed = support.claim_job(session, job.id)
    with session_factory.begin() as session:
        if support.record_result(session, claimed, result):
            catalog_store.record_enrichment(session, claimed, result, model="tiny")


def generated(text_, parsed=None, finish_reason="stop"):
    return JobResult(status=JobStatus.SUCCEEDED, output_text=text_, parsed=parsed, finish_reason=finish_reason)


def loaded(value):
    return json.loads(value) if isinstance(value, str) else value


def test_decisions_are_stored_and_publishable_follows_them(session_factory, tmp_path):
    path = tmp_path / "c.csv"
    path.write_text(CSV, encoding="utf-8")
    catalog = read_catalog(str(path), parse_spec(SPEC))
    requests = catalog_requests(catalog)
    with session_factory.begin() as session:
        _, jobs = support.create_batch(session, requests, model="tiny")
    by_id = {job.custom_id: job for job in jobs}
    outcomes = {
        "1/category": JobResult(status=JobStatus.SUCCEEDED, label="Home", label_probs={"Home": 0.9, "Kitchen": 0.1}),
        "1/description": generated("This Spaces cotton duvet cover in blue is soft."),
        "1/attributes": generated('{"brand":"Spaces","color":"blue"}', {"brand": "Spaces", "color": "blue"}),
        "2/category": JobResult(status=JobStatus.SUCCEEDED, label="Home", label_probs={"Home": 0.9, "Kitchen": 0.1}),
        "2/description": generated("This Spaces towel is made with 100% wool."),
        "2/attributes": generated('{"brand":"Spaces","color":null}', {"brand": "Spaces", "color": None}),
        "3/category": JobResult(status=JobStatus.SUCCEEDED, label="Kitchen", label_probs={"Kitchen": 0.6, "Home": 0.4}),
        "3/description": generated("A Milton steel bottle."),
        "3/attributes": generated('{"brand":"Acme","color":"Bl', None, "length"),
    }
    for custom_id, result in outcomes.items():
        run(session_factory, by_id[custom_id], result)
    with session_factory() as session:
        rows = session.execute(text(
            "SELECT product_id, category_decision, description_decision, description_reasons, attributes_decision, "
            "attributes_reasons, publishable FROM latest_enrichment WHERE catalog = :c ORDER BY product_id"),
            {"c": catalog_key(catalog)}).all()
    assert [(r[0], r[1], r[2], loaded(r[3]), r[4], loaded(r[5]), bool(r[6])) for r in rows] == [
        ("1", "auto", "auto", [], "auto", [], True),
        ("2", "auto", "review", [{"code": "unsupported_number", "text": "100%"},
                                 {"code": "unsupported_material", "text": "wool"}], "auto", [], False),
        ("3", "auto", "auto", [], "reject", [{"code": "cut_by_max_tokens"}], False),
    ]


def test_a_row_whose_spec_asks_for_attributes_is_not_publishable_without_them(session_factory, tmp_path):
    path = tmp_path / "c.csv"
    path.write_text(CSV, encoding="utf-8")
    catalog = read_catalog(str(path), parse_spec(SPEC), limit=1)
    with session_factory.begin() as session:
        _, jobs = support.create_batch(session, catalog_requests(catalog), model="tiny")
    by_id = {job.custom_id: job for job in jobs}
    run(session_factory, by_id["1/category"], JobResult(status=JobStatus.SUCCEEDED, label="Home",
                                                        label_probs={"Home": 1.0}))
    run(session_factory, by_id["1/description"], generated("A soft Spaces cotton duvet cover."))

    def publishable():
        with session_factory() as session:
            return [bool(p) for p in session.execute(text("SELECT publishable FROM latest_enrichment WHERE catalog = :c"),
                                                     {"c": catalog_key(catalog)}).scalars()]

    assert publishable() == [False]  # attributes wanted, not yet written
    run(session_factory, by_id["1/attributes"], generated('{"brand":"Spaces","color":null}',
                                                          {"brand": "Spaces", "color": None}))
    assert publishable() == [True]
