"""Attribute extraction under a JSON schema, scored against the catalogs' own ground truth.

Usage::

    python -m bench.extraction [--catalog flipkart|bigbasket] [--products 500] [--threads N]

The catalog job's own extraction requests (``weir.jobs.catalog.extract_request``: the shipped
spec's ``[extract]`` schema, prompt and sampling; greedy), one per product of the first
``--products`` of the catalog, through the engine directly. Printed from one run: the share of
outputs that parse and validate against the schema (``jsonschema``; outputs cut by ``max_tokens``
counted apart, as ``length``), tokens/s, and per field, over the products whose ground truth has
the field (the others cannot be judged; their non-null predictions are counted as ``unjudged``),
the precision (correct / predicted non-null) and the recall (correct / products with the field).
Flipkart's ground truth is its ``product_specifications`` (Ruby-hash key/value pairs); BigBasket's
is its ``brand`` column. Values compare after case folding and whitespace normalisation; a
predicted value is correct when it equals the truth or one contains the other as whole words
(``"Nike"`` for ``"Nike Inc"``), and numbers compare as numbers. ``--spec FILE`` scores another
spec's ``[extract]`` (its fields must be the catalog's truth fields' names).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from weir.jobs.catalog.enrichment import catalog_key, extract_request, read_catalog
from bench.ground_truth import TRUTH_FIELDS, normalise, read_truth, values_match
from weir.jobs.catalog.spec import load_spec

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
FILES = {"flipkart": "flipkart_products.csv", "bigbasket": "bigbasket_products.csv"}


def score(products, parsed, truth, truth_fields) -> list[tuple]:
    """Per field: (field, judged, predicted, correct, unjudged predictions)."""
    rows = []
    for name, truth_key in truth_fields.items():
        judged = predicted = correct = unjudged = 0
        for p, value in zip(products, parsed):
            true = truth.get(p.product_id, {}).get(truth_key)
            pred = None if value is None else value.get(name)
            has_pred = pred not in (None, "") and normalise(pred) != ""
            if true is None:
                unjudged += has_pred
                continue
            judged += 1
            predicted += has_pred
            correct += has_pred and values_match(pred, true)
        rows.append((name, judged, predicted, correct, unjudged))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalog", choices=sorted(FILES), default="flipkart")
    ap.add_argument("--spec", default=None, help="job spec (default: the catalog's shipped spec)")
    ap.add_argument("--products", type=int, default=500, help="first N products of the catalog")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--show", type=int, default=5, help="print this many outputs")
    ap.add_argument("--json", default=None, help="write every output and its truth to this file")
    args = ap.parse_args(argv)

    import jsonschema
    import torch

    from weir.engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = load_spec(args.spec or args.catalog)
    path = os.path.join(DATA, FILES[args.catalog])
    catalog = read_catalog(path, spec, limit=args.products)
    products = catalog.products
    truth = read_truth(path, spec.columns.id, TRUTH_FIELDS[args.catalog], [p.product_id for p in products])
    requests = [extract_request(p, spec, catalog_key(catalog)) for p in products]
    llm = LLM(None, max_model_len=1024)
    prompts = [llm.encode_prompt(r.engine_prompt()) for r in requests]
    params = [r.sampling_params() for r in requests]
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    comps = [o.outputs[0] for o in outs]
    parsed, cut, invalid = [], 0, 0
    for c in comps:
        value = None
        if c.finish_reason == "length":
            cut += 1
        else:
            try:
                value = json.loads(c.text)
                jsonschema.validate(value, spec.extract.schema)
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
                value = None
        parsed.append(value)
    n = len(comps)
    tokens = sum(len(c.token_ids) for c in comps)
    sampling = {k: v for k, v in spec.extract.sampling.items()}
    print(f"{args.catalog}: {n} products, {sampling}: {n - cut - invalid} valid, {invalid} invalid, "
          f"{cut} cut by max_tokens (length); valid among finished {(n - cut - invalid) / max(1, n - cut):.1%}; "
          f"{tokens / n:.1f} tokens/product, {tokens / wall:.1f} tok/s, {wall:.0f} s")
    print(f"{'field':12s} {'judged':>6s} {'pred':>6s} {'correct':>8s} {'precision':>9s} {'recall':>7s} {'unjudged':>8s}")
    for name, judged, predicted, correct, unjudged in score(products, parsed, truth, TRUTH_FIELDS[args.catalog]):
        print(f"{name:12s} {judged:6d} {predicted:6d} {correct:8d} {correct / max(1, predicted):9.1%} "
              f"{correct / max(1, judged):7.1%} {unjudged:8d}")
    for p, c in list(zip(products, comps))[:args.show]:
        print(f"- {p.name[:60]!r} -> {c.text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"product_id": p.product_id, "name": p.name, "text": c.text, "finish_reason": c.finish_reason,
                        "truth": truth.get(p.product_id, {})} for p, c in zip(products, comps)], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
