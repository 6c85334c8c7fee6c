"""Catalog job quality: category accuracy of each classification alternative and the clean rate
of descriptions under each decoding choice, with the engine directly (same prompts as the job).

Usage::

    python -m bench.catalog_quality CATALOG.csv --spec bigbasket --limit 1000 \
        [--classify zero_shot,knn,exemplars,exemplars_cal] [--describe spec,none,stop,rp1.1,...] \
        [--num-describe 200] [--show 10] [--json out.json]

Classification alternatives (labels and ground truth: the spec's taxonomy level of the catalog's
own column; exemplars come from the leave-one-out pool of the whole file, :mod:`weir.jobs.exemplars`):

- ``zero_shot``: each label with its commonest sub-labels, calibrated against ``N/A`` (the job's
  form before exemplars).
- ``knn``: no model; the label with the largest summed TF-IDF similarity over the 10 nearest.
- ``exemplars``: the spec's ``num_exemplars`` nearest as few-shot lines, labels scored plainly.
- ``exemplars_cal``: the same, calibrated against the same exemplars with ``N/A``.
- ``exemplarsK`` (e.g. ``exemplars4``): the few-shot form with K exemplars.

Description configurations: ``spec`` (the spec's sampling), ``none`` (no stop, no penalty: the job
before), ``stop`` (stop at a newline), ``rpX`` (stop and repetition_penalty X), ``fpX`` (stop and
frequency_penalty X). Each reports the share of descriptions whose quality is ``ok``
(:func:`weir.jobs.quality.description_quality`), the flags, mean tokens, time per product.

Cost per product: wall seconds of the engine call over the products, and prompt tokens per product
(calibration prompts included; tokens served from the prefix cache are counted, and shown apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections import Counter

from weir.jobs.catalog import classify_request, describe_request, read_catalog
from weir.jobs.exemplars import ExemplarIndex
from weir.jobs.quality import OK, description_quality
from weir.jobs.spec import load_spec

KNN_K = 10


def classify_alternative(llm, catalog, index, name):
    """(predicted labels, seconds, prompt tokens, cached tokens) of one alternative."""
    from weir.engine.outputs import calibrate

    products = catalog.products
    t = time.perf_counter()
    if name == "knn":
        preds = []
        for p in products:
            votes = index.vote(p.product_id, p.name, p.brand, KNN_K)
            preds.append(max(votes, key=votes.get) if votes else catalog.labels[0])
        return preds, time.perf_counter() - t, 0, 0
    if name == "zero_shot":
        reqs = [classify_request(p, catalog) for p in products]
    else:
        k = int(name[len("exemplars"):].removesuffix("_cal") or catalog.spec.classify.num_exemplars)
        cal = name.endswith("_cal")
        reqs = [classify_request(p, catalog, index.nearest(p.product_id, p.name, p.brand, k), calibrate=cal)
                for p in products]
    labels, texts = reqs[0].labels, reqs[0].label_texts
    outs = llm.classify([r.engine_prompt() for r in reqs], labels, texts)
    tokens = sum(o.num_prompt_tokens for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    cal_prompts = [r.engine_calibration_prompt() for r in reqs]
    if cal_prompts[0] is not None:
        distinct = list(dict.fromkeys(cal_prompts))
        priors = dict(zip(distinct, llm.classify(distinct, labels, texts)))
        tokens += sum(o.num_prompt_tokens for o in priors.values())
        cached += sum(o.num_cached_tokens for o in priors.values())
        outs = [calibrate(o, priors[c]) for o, c in zip(outs, cal_prompts)]
    return [o.label for o in outs], time.perf_counter() - t, tokens, cached


DESCRIBE_CONFIGS = {
    "none": dict(stop=None, repetition_penalty=1.0, frequency_penalty=0.0),
    "stop": dict(stop=["\n"], repetition_penalty=1.0, frequency_penalty=0.0),
}


def describe_config(spec, name):
    sampling = dict(spec.describe.sampling)
    if name in DESCRIBE_CONFIGS:
        sampling.update(DESCRIBE_CONFIGS[name])
    elif name.startswith("rp"):
        sampling.update(stop=["\n"], repetition_penalty=float(name[2:]), frequency_penalty=0.0)
    elif name.startswith("fp"):
        sampling.update(stop=["\n"], repetition_penalty=1.0, frequency_penalty=float(name[2:]))
    elif name.startswith("max"):
        sampling.update(max_tokens=int(name[3:]))
    elif name != "spec":
        raise SystemExit(f"unknown description configuration {name!r}")
    return sampling


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("catalog")
    ap.add_argument("--spec", default=None, help="spec file or shipped spec name")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--classify", default="zero_shot,knn,exemplars")
    ap.add_argument("--describe", default="spec")
    ap.add_argument("--num-describe", type=int, default=None, help="describe only the first N (default --limit)")
    ap.add_argument("--show", type=int, default=10, help="random descriptions shown per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from weir import LLM, SamplingParams

    spec = load_spec(args.spec)
    catalog = read_catalog(args.catalog, spec, limit=args.limit)
    products = catalog.products
    truth = [p.category for p in products]
    majority = Counter(truth).most_common(1)[0]
    print(f"catalog {args.catalog}, spec {spec.path or 'default'}: {len(products)} products, "
          f"{len(catalog.labels)} labels, pool {len(catalog.pool)}; majority baseline "
          f"{100 * majority[1] / len(products):.1f} % ({majority[0]})")
    llm = LLM(dtype=args.dtype, max_model_len=2048)
    report = {"catalog": args.catalog, "spec": spec.path, "num_products": len(products),
              "majority": majority[1] / len(products), "classify": {}, "describe": {}}
    index = ExemplarIndex(catalog.pool) if catalog.pool else None
    for name in filter(None, args.classify.split(",")):
        llm.reset_prefix_cache()
        preds, wall_s, tokens, cached = classify_alternative(llm, catalog, index, name)
        acc = sum(a == b for a, b in zip(preds, truth)) / len(products)
        n = len(products)
        print(f"classify {name:14s} accuracy {100 * acc:5.1f} %   {1000 * wall_s / n:7.1f} ms/product   "
              f"{tokens / n:6.1f} prompt tokens/product ({cached / n:.1f} cached)", flush=True)
        report["classify"][name] = dict(accuracy=acc, ms_per_product=1000 * wall_s / n,
                                        prompt_tokens_per_product=tokens / n, cached_per_product=cached / n)
    described = products[:args.num_describe or len(products)]
    reqs = [describe_request(p, spec) for p in described]
    rng = random.Random(args.seed)
    for name in filter(None, args.describe.split(",")):
        sampling = describe_config(spec, name)
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([r.engine_prompt() for r in reqs], SamplingParams(**sampling))
        wall_s = time.perf_counter() - t
        texts = [o.outputs[0].text.strip() for o in outs]
        quality = [description_quality(x) for x in texts]
        flags = Counter(quality)
        n = len(described)
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"describe {name:8s} clean {100 * flags[OK] / n:5.1f} %  flags {dict(flags)}  "
              f"{num_tokens / n:.1f} tokens/product  {1000 * wall_s / n:.0f} ms/product  sampling {sampling}",
              flush=True)
        shown = rng.sample(range(n), min(args.show, n))
        for i in shown:
            print(f"    [{described[i].product_id}] {described[i].name!r} -> {texts[i]!r} ({quality[i]})")
        report["describe"][name] = dict(clean=flags[OK] / n, flags=dict(flags), sampling=sampling,
                                        tokens_per_product=num_tokens / n, ms_per_product=1000 * wall_s / n,
                                        shown=[dict(id=described[i].product_id, name=described[i].name,
                                                    text=texts[i], quality=quality[i]) for i in shown])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
