"""Attribute extraction under a JSON schema, scored against the catalogs' own ground truth.

Usage::

    python -m bench.extraction [--catalog flipkart|bigbasket] [--products 500] [--max-tokens 96]

One greedy request per product, constrained by the catalog's extraction schema
(``weir.jobs.extraction``). Printed from one run: the share of outputs that parse and validate
(outputs cut by ``max_tokens`` counted apart, as ``length``), tokens/s, and per field, over the
products whose ground truth has the field (the others cannot be judged; their non-null predictions
are counted as ``unjudged``), the precision (correct / predicted non-null) and the recall
(correct / products with the field).
Flipkart's ground truth is its ``product_specifications`` (Ruby-hash key/value pairs); BigBasket's
is its ``brand`` column. Values compare after case folding and whitespace normalisation; a
predicted value is correct when it equals the truth or one contains the other as whole words
(``"Nike"`` for ``"Nike Inc"``), and numbers compare as numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from weir.jobs.extraction import (CATALOG_EXTRACTION, extraction_messages, normalise, read_products, values_match)

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalog", choices=sorted(CATALOG_EXTRACTION), default="flipkart")
    ap.add_argument("--products", type=int, default=500, help="first N products of the catalog")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--show", type=int, default=5, help="print this many outputs")
    args = ap.parse_args(argv)

    import jsonschema

    from weir.engine import LLM, SamplingParams, StructuredOutputsParams

    spec = CATALOG_EXTRACTION[args.catalog]
    products = read_products(os.path.join(DATA, spec.file), spec, args.products)
    llm = LLM(None, max_model_len=1024)
    prompts = [llm.encode_prompt(extraction_messages(p, spec)) for p in products]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            structured_outputs=StructuredOutputsParams(json=spec.schema, disable_any_whitespace=True))
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    comps = [o.outputs[0] for o in outs]
    parsed, cut, invalid = [], 0, 0
    for c in comps:
        if c.finish_reason == "length":
            cut += 1
            parsed.append(None)
            continue
        try:
            value = json.loads(c.text)
            jsonschema.validate(value, spec.schema)
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
            parsed.append(None)
            continue
        parsed.append(value)
    n = len(comps)
    tokens = sum(len(c.token_ids) for c in comps)
    print(f"{args.catalog}: {n} products, greedy, max_tokens={args.max_tokens}: "
          f"{n - cut - invalid} valid, {invalid} invalid, {cut} cut by max_tokens (length); "
          f"valid among finished {(n - cut - invalid) / max(1, n - cut):.1%}; {tokens / wall:.1f} tok/s, {wall:.0f} s")
    print(f"{'field':16s} {'truth':>6s} {'pred':>6s} {'correct':>8s} {'precision':>9s} {'recall':>7s} "
          f"{'unjudged':>8s}")
    for field, truth_key in spec.truth_fields.items():
        truth_n = pred_n = correct = unjudged = 0
        for p, v in zip(products, parsed):
            truth = p.truth.get(truth_key)
            pred = None if v is None else v.get(field)
            has_pred = pred not in (None, "") and normalise(pred) != ""
            if truth is None:
                unjudged += has_pred
                continue
            truth_n += 1
            pred_n += has_pred
            correct += has_pred and values_match(pred, truth)
        print(f"{field:16s} {truth_n:6d} {pred_n:6d} {correct:8d} {correct / max(1, pred_n):9.1%} "
              f"{correct / max(1, truth_n):7.1%} {unjudged:8d}")
    for p, c in list(zip(products, comps))[:args.show]:
        print(f"- {p.name[:60]!r} -> {c.text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
