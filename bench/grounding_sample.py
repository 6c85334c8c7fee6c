"""The labelled sample behind the publish decision's figures: descriptions and extractions of 100
products per shipped catalog, each description marked by hand supported or unsupported.

    python -m bench.grounding_sample generate [--catalogs bigbasket,flipkart] [--num 100] [--part tuning]
    python -m bench.grounding_sample report   [--catalogs bigbasket,flipkart] [--part tuning]
    python -m bench.grounding_sample generate --part heldout --num 300   (then report --part heldout)
    python -m bench.grounding_sample generate --part wide --num 1500     (then report --part wide)
    python -m bench.grounding_sample generate --part fresh --num 1500 --catalogs bigbasket
    python -m bench.grounding_sample generate --part untouched --num 1500

``generate`` draws ``--num`` products (seed 25) from the second half of each catalog file (the
rows no prompt, exemplar or threshold was tuned on), writes each one's description and attribute
extraction with the packaged SmolLM2-135M-Instruct exactly as the catalog job does (the spec's
prompts and sampling, the description's one retry with ``retry_sampling`` when the quality check
flags it, :func:`weir.jobs.catalog.quality.pick_description`), and stores one JSON object per
product in ``tests/data/grounding/<catalog>.jsonl``: the listing (``name``, ``brand``,
``category``, ``source_description``), ``description`` and its ``description_finish_reason``,
``attributes_text`` / ``attributes`` / ``attributes_finish_reason``, ``truth`` (the catalog's own
ground truth per extracted field: Flipkart's ``product_specifications``, BigBasket's ``brand``
column; :mod:`bench.ground_truth`), and the hand labels: ``readers``, one
``{"label", "unsupported"}`` per reader (each read the listings and descriptions alone, never the
checker's code; ``unsupported`` lists the description's phrases the listing does not support),
and ``label``, ``unsupported`` when any reader found an unsupported claim (null until labelled). ``--part tuning``
draws as many from the first half of each file instead, into ``tests/data/grounding/tuning/``:
the rows the grounding check's rules were tuned on, kept apart from the sample they are judged on.
``--part heldout`` draws ``--num`` more products from the second half (seed 26, none of the
sample's) and extracts their attributes only, into ``tests/data/grounding/heldout/``: the
extraction's figures on rows no evidence kind or extraction rule was written after (the catalogs'
own truth needs no reader, so these rows need no labels). ``--part wide`` draws up to ``--num``
more products from the second half (seed 27, none of the sample's or the held-out part's: every
one left, where fewer remain) and describes them only, into ``tests/data/grounding/wide/``: a
sample large enough to hold tens of ``auto`` descriptions, to measure the precision of ``auto``
where the 100-product sample holds too few to show it. Two readers labelled its ``auto``
descriptions mixed with as many ``review`` ones drawn at random (seed 7), shuffled, so that they
could not tell which the checker passed; the other rows keep ``label`` null. ``--part fresh``
draws the same way from what is left after every other part (seed 28; BigBasket only: the wide
part took every Flipkart row left) into ``tests/data/grounding/fresh/``, labelled the same way:
the rows that judge :data:`weir.jobs.catalog.decisions.MAX_UNLISTED_WORDS` as chosen on the wide
part. ``--part untouched`` draws up to ``--num`` products (seed 29) from the first half of each
file, leaving out the tuning part's rows and the first :data:`FIRST_RUN` products (the ones every
``--limit`` run of the catalog job and its benchmarks described), and describes and extracts them,
into ``tests/data/grounding/untouched/``, labelled as the wide part: products no decision rule was
chosen on, drawn once the second halves had none left, to judge the rules chosen on the parts
before it (``several_in_listing`` among them).

The labelling rule: a description is ``unsupported`` when it states any checkable fact the
listing (title, brand, category, source description) does not: a product type, material or
ingredient, number, size or weight, price or currency, place or origin, brand, colour, feature,
health or safety claim, or a specific audience (a misspelt brand or name names something else).
Praise and generic uses ("perfect for everyday use") are not facts. ``supported`` otherwise.

``report`` recomputes the decisions from the stored texts (no model) and prints, per catalog: the
descriptions' decision counts, the precision of ``auto`` descriptions against the hand labels
(an ``auto`` description labelled unsupported counts against) and the share reaching ``auto``;
per extracted field, the precision of ``auto`` values against the truth (where the truth has the
field), the share of values ``auto``, and the null rate where the truth lacks the field.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections import Counter
from typing import Any, Optional

from bench.ground_truth import TRUTH_FIELDS, read_truth, values_match

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO_ROOT, "..", "shared", "data")
FILES = {"bigbasket": "bigbasket_products.csv", "flipkart": "flipkart_products.csv"}
SAMPLE_DIR = os.path.join(REPO_ROOT, "tests", "data", "grounding")
SEED = 25
HELDOUT_SEED = 26
WIDE_SEED = 27
FRESH_SEED = 28
UNTOUCHED_SEED = 29
FIRST_RUN = 200
"""The products at the head of each file that ``--limit`` runs described: never drawn into a part."""
PARTS = ("sample", "tuning", "heldout", "wide", "fresh", "untouched")
PART_SEEDS = {"heldout": HELDOUT_SEED, "wide": WIDE_SEED, "fresh": FRESH_SEED, "untouched": UNTOUCHED_SEED}
FIRST_HALF = ("tuning", "untouched")
DESCRIBED_ONLY = ("wide", "fresh")


def sample_path(catalog: str, part: str = "sample") -> str:
    return os.path.join(SAMPLE_DIR, *([part] if part != "sample" else []), f"{catalog}.jsonl")


def read_sample(catalog: str, part: str = "sample") -> list[dict[str, Any]]:
    """The stored sample of ``catalog`` (``bigbasket`` or ``flipkart``), one dict per product
    (``part="tuning"``: the tuning rows)."""
    with open(sample_path(catalog, part), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def listing(row: dict[str, Any]):
    from weir.jobs.catalog.grounding import Listing

    return Listing(name=row["name"], brand=row["brand"], description=row["source_description"],
                   category=row["category"])


def part_ids(catalog_name: str, parts) -> set[str]:
    """The product ids that ``parts`` hold for the catalog (a part with no file for it holds none)."""
    return {row["product_id"] for part in parts if os.path.exists(sample_path(catalog_name, part))
            for row in read_sample(catalog_name, part)}


def generate(catalog_name: str, num: int, part: str = "sample") -> None:
    from weir.engine import LLM
    from weir.jobs.catalog.enrichment import catalog_key, describe_request, extract_request, read_catalog
    from weir.jobs.catalog.quality import description_quality, OK, pick_description
    from weir.jobs.catalog.spec import load_spec

    spec = load_spec(catalog_name)
    path = os.path.join(DATA, FILES[catalog_name])
    catalog = read_catalog(path, spec)
    middle = len(catalog.products) // 2
    half = catalog.products[:middle] if part in FIRST_HALF else catalog.products[middle:]
    if part == "untouched":
        half = half[FIRST_RUN:]
    if part in PART_SEEDS:  # products no earlier part holds
        taken = part_ids(catalog_name, PARTS[:PARTS.index(part)])
        pool = [p for p in half if p.product_id not in taken]
        products = random.Random(PART_SEEDS[part]).sample(pool, min(num, len(pool)))
        if not products:
            raise SystemExit(f"{catalog_name}: no product is left for --part {part}")
    else:
        products = random.Random(SEED).sample(half, num)
    key = catalog_key(catalog)
    truth = read_truth(path, spec.columns.id, TRUTH_FIELDS[catalog_name], [p.product_id for p in products])
    llm = LLM(None, max_model_len=2048)

    describe = [describe_request(p, spec, key) for p in products] if part != "heldout" else []
    prompts = [llm.encode_prompt(r.engine_prompt()) for r in describe]
    first = [o.outputs[0] for o in llm.generate(prompts, [r.sampling_params() for r in describe])] if describe else []
    final = list(first)
    retry = [i for i, c in enumerate(first) if description_quality(c.text) != OK]
    if retry and spec.describe.retry_sampling:
        again = llm.generate([prompts[i] for i in retry],
                             [describe[i].params_with(spec.describe.retry_sampling) for i in retry])
        for i, out in zip(retry, again):
            final[i] = [first[i], out.outputs[0]][pick_description([first[i].text, out.outputs[0].text])]

    extract = [extract_request(p, spec, key) for p in products] if spec.extract.enabled and part not in DESCRIBED_ONLY else []
    extracted = [o.outputs[0] for o in llm.generate([llm.encode_prompt(r.engine_prompt()) for r in extract],
                                                    [r.sampling_params() for r in extract])] if extract else []
    fields = TRUTH_FIELDS[catalog_name]
    path = sample_path(catalog_name, part)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, p in enumerate(products):
            row = dict(product_id=p.product_id, name=p.name, brand=p.brand, category=p.category,
                       source_description=p.description)
            if final:
                row.update(description=final[i].text, description_finish_reason=final[i].finish_reason)
            if extracted:
                c = extracted[i]
                try:
                    parsed = json.loads(c.text) if c.finish_reason != "length" else None
                except ValueError:
                    parsed = None
                facts = truth.get(p.product_id, {})
                row.update(attributes_text=c.text, attributes=parsed, attributes_finish_reason=c.finish_reason,
                           truth={name: facts[where] for name, where in fields.items() if where in facts})
            if final:
                row.update(readers=[], label=None)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{catalog_name}: {len(products)} products -> {path}")


def description_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Decision counts of the sample's descriptions and, against the hand labels, the auto ones'
    precision: ``{"auto", "review", "reject", "auto_unsupported", "unlabelled"}``."""
    from weir.jobs.catalog.decisions import judge_description

    counts: Counter = Counter()
    for row in rows:
        decision = judge_description(row["description"], listing(row)).decision
        counts[decision] += 1
        if decision == "auto":
            if row.get("label") is None:
                counts["unlabelled"] += 1
            elif row["label"] == "unsupported":
                counts["auto_unsupported"] += 1
    return {k: counts[k] for k in ("auto", "review", "reject", "auto_unsupported", "unlabelled")}


def attribute_figures(rows: list[dict[str, Any]], catalog_name: str) -> dict[str, dict[str, int]]:
    """Per field with a truth source: ``{"auto", "auto_with_truth", "auto_correct", "values",
    "truth_absent", "null_where_absent"}`` over the sample's extractions (a value is ``auto`` when
    its extraction is not rejected and no reason names its field)."""
    from weir.jobs.catalog.decisions import judge_attributes
    from weir.jobs.catalog.enrichment import example_values
    from weir.jobs.catalog.spec import load_spec

    spec = load_spec(catalog_name)
    examples = example_values(spec)
    out: dict[str, Counter] = {name: Counter() for name in TRUTH_FIELDS[catalog_name]}
    for row in rows:
        parsed = row.get("attributes")
        decision = judge_attributes(parsed, row.get("attributes_finish_reason"), listing(row), examples,
                                    spec.extract.evidence)
        flagged = {r.get("field") for r in decision.reasons}
        for name, c in out.items():
            value = parsed.get(name) if isinstance(parsed, dict) else None
            truth = row.get("truth", {}).get(name)
            if truth is None:
                c["truth_absent"] += 1
                c["null_where_absent"] += value is None
            if value is None:
                continue
            c["values"] += 1
            if decision.decision == "reject" or name in flagged:
                continue
            c["auto"] += 1
            if truth is not None:
                c["auto_with_truth"] += 1
                c["auto_correct"] += values_match(value, truth)
    keys = ("values", "auto", "auto_with_truth", "auto_correct", "truth_absent", "null_where_absent")
    return {name: {k: c[k] for k in keys} for name, c in out.items()}


def _share(a: int, b: int) -> str:
    return f"{100 * a / b:5.1f} %" if b else "    –  "


def report(catalog_name: str, part: str = "sample") -> None:
    rows = read_sample(catalog_name, part)
    described = [row for row in rows if "description" in row]
    if not described:
        print(f"{catalog_name}: {len(rows)} products, attributes only")
    else:
        d = description_figures(described)
        labelled = d["auto"] - d["unlabelled"]
        print(f"{catalog_name}: {len(rows)} descriptions  auto {d['auto']}  review {d['review']}  reject {d['reject']}  "
              f"share auto {_share(d['auto'], len(rows))}  "
              f"precision of auto {_share(labelled - d['auto_unsupported'], labelled)}"
              f" ({d['auto_unsupported']} of {labelled} labelled auto unsupported; {d['unlabelled']} unlabelled)")
    if any("attributes" in row for row in rows):
        for name, c in attribute_figures(rows, catalog_name).items():
            print(f"  {name:10s} values {c['values']:3d}  auto {c['auto']:3d} ({_share(c['auto'], c['values'])})  "
                  f"precision of auto {_share(c['auto_correct'], c['auto_with_truth'])} "
                  f"({c['auto_correct']}/{c['auto_with_truth']} with truth)  "
                  f"null where truth absent {_share(c['null_where_absent'], c['truth_absent'])} "
                  f"({c['null_where_absent']}/{c['truth_absent']})")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["generate", "report"])
    ap.add_argument("--catalogs", default="bigbasket,flipkart")
    ap.add_argument("--num", type=int, default=100)
    ap.add_argument("--part", choices=PARTS, default="sample")
    args = ap.parse_args(argv)
    for name in args.catalogs.split(","):
        generate(name, args.num, args.part) if args.command == "generate" else report(name, args.part)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
