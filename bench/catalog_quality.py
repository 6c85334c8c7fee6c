"""Catalog job quality: category accuracy of each classification alternative and the clean rate
of descriptions under each decoding choice, with the engine directly (same prompts as the job).

Usage::

    python -m bench.catalog_quality CATALOG.csv --spec bigbasket --limit 1000 \
        [--classify zero_shot,knn,exemplars,exemplars_cal] [--describe spec,none,stop,rp1.1,...] \
        [--start 0] [--num-describe 200] [--show 10] [--flagged] [--json out.json]

Classification alternatives (labels and ground truth: the spec's taxonomy level of the catalog's
own column; exemplars come from the leave-one-out pool of the whole file, :mod:`weir.jobs.catalog.exemplars`):

- ``zero_shot``: each label with its commonest sub-labels, calibrated against ``N/A`` (the job's
  form before exemplars).
- ``knn``: no model; the label with the largest summed TF-IDF similarity over the 10 nearest.
- ``exemplars``: the spec's ``num_exemplars`` nearest as few-shot lines, labels scored plainly.
- ``exemplars_cal``: the same, calibrated against the same exemplars with ``N/A``.
- ``exemplarsK`` (e.g. ``exemplars4``): the few-shot form with K exemplars.

Description configurations: ``spec`` (the spec's sampling), ``none`` (no stop, no penalty: the job
before), ``stop`` (stop at a newline), ``rpX`` (stop and repetition_penalty X), ``fpX`` (stop and
frequency_penalty X), ``sent`` (stop at a newline or the first sentence end ". ", "! ", "? ",
kept in the text, max_tokens 96), ``sentrpX`` (the same with repetition_penalty X); any of them
followed by ``:key=value`` overrides, after any ``+NAME`` (``spec:fp=0.3:min=4``: ``fp`` frequency_penalty, ``pp``
presence_penalty, ``rp`` repetition_penalty, ``min`` min_tokens, ``max`` max_tokens, ``t``
temperature, ``stop`` one of :data:`STOP_SETS`). ``CONFIG+NAME`` replaces the user turn with
:data:`USER_PROMPTS` ``NAME``. Each reports the share of descriptions whose quality is ``ok``
(:func:`weir.jobs.catalog.quality.description_quality`), the flags, mean tokens, time per product;
``--flagged`` prints every flagged one. ``--retry`` does what the worker does with the spec's
``[describe.retry_sampling]``: each flagged description is written once more with those fields
replaced and the first clean attempt kept (:func:`weir.jobs.catalog.quality.pick_description`); the clean
rate and tokens are then reported after the second attempt, its tokens included.

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

from weir.jobs.catalog.enrichment import catalog_key, classify_request, describe_request, read_catalog
from weir.jobs.catalog.exemplars import ExemplarIndex
from weir.jobs.catalog.quality import OK, description_quality, pick_description
from weir.jobs.catalog.spec import load_spec

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


USER_PROMPTS = {
    "ask": "Product: {name}\nBrand: {brand}\n\nWrite the one-sentence description of this product.",
    "first": "Write the one-sentence description of this product.\n\nProduct: {name}\nBrand: {brand}",
    "page": "Write one sentence for the product page of the {name}.\nThe brand is {brand}.",
    "own": "Product: {name}\nBrand: {brand}\n\nIn one full sentence, in your own words, tell a shopper "
           "what this product is and why they would want it.",
    "this": "Product: {name}\nBrand: {brand}\n\nIn one full sentence that starts with the word This, tell a "
            "shopper what this product is and why they would want it.",
    "sentence": "Product: {name}\nBrand: {brand}\n\nWrite one full sentence, not a title, that tells a shopper "
                "what this product is and why they would want it.",
}
"""User-turn variants (``CONFIG+NAME``; ``ask`` is the job's before, ``sentence`` its own now); a
listing of the fields alone invites the model to echo them."""

SENTENCE_STOPS = ["\n", ". ", "! ", "? "]

STOP_SETS = {
    "sent": SENTENCE_STOPS,
    "nl": ["\n"],
    "ends": [". ", "! ", "? "],
    "para": ["\n\n", ". ", "! ", "? "],
}
"""Stop sets for ``:stop=NAME``: ``sent`` the first sentence end or line break; ``nl`` a line
break only; ``ends`` sentence ends only (a line break does not end); ``para`` a blank line or a
sentence end."""

OVERRIDES = {"fp": ("frequency_penalty", float), "pp": ("presence_penalty", float),
             "rp": ("repetition_penalty", float), "min": ("min_tokens", int), "max": ("max_tokens", int),
             "t": ("temperature", float), "stop": ("stop", STOP_SETS.__getitem__)}

DESCRIBE_CONFIGS = {
    "none": dict(stop=None, repetition_penalty=1.0, frequency_penalty=0.0),
    "stop": dict(stop=["\n"], repetition_penalty=1.0, frequency_penalty=0.0),
}


def describe_config(spec, name):
    name, *overrides = name.split(":")
    sampling = _base_config(spec, name)
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in OVERRIDES:
            raise SystemExit(f"unknown override {key!r} (known: {', '.join(OVERRIDES)})")
        field, parse = OVERRIDES[key]
        sampling[field] = parse(value)
    return sampling


def _base_config(spec, name):
    sampling = dict(spec.describe.sampling)
    if name in DESCRIBE_CONFIGS:
        sampling.update(DESCRIBE_CONFIGS[name])
    elif name.startswith("sent"):
        # end at the first sentence end (the prompt asks for one sentence), room for a long one
        rest = name[len("sent"):]
        sampling.update(stop=SENTENCE_STOPS, include_stop_str_in_output=True, max_tokens=96,
                        repetition_penalty=float(rest[2:]) if rest.startswith("rp") else 1.0,
                        frequency_penalty=0.0)
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
    ap.add_argument("--start", type=int, default=0, help="skip the first N products (a held-out slice)")
    ap.add_argument("--classify", default="zero_shot,knn,exemplars")
    ap.add_argument("--describe", default="spec")
    ap.add_argument("--num-describe", type=int, default=None, help="describe only the first N (default --limit)")
    ap.add_argument("--show", type=int, default=10, help="random descriptions shown per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flagged", action="store_true", help="also print every flagged description")
    ap.add_argument("--retry", action="store_true",
                    help="write each flagged description once more with the spec's retry sampling, as the worker does")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk", type=int, default=100, help="products per classification call")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from weir import LLM, SamplingParams

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    spec = load_spec(args.spec)
    catalog = read_catalog(args.catalog, spec, limit=args.start + args.limit)
    catalog = dataclasses.replace(catalog, products=catalog.products[args.start:])
    products = catalog.products
    truth = [p.category for p in products]
    majority = Counter(truth).most_common(1)[0]
    print(f"catalog {args.catalog}, spec {spec.path or 'default'}: {len(products)} products "
          f"from #{args.start}, "
          f"{len(catalog.labels)} labels, pool {len(catalog.pool)}; majority baseline "
          f"{100 * majority[1] / len(products):.1f} % ({majority[0]})")
    model_work = [n for n in args.classify.split(",") if n and n != "knn"] or args.describe
    llm = LLM(dtype=args.dtype, max_model_len=2048) if model_work else None
    report = {"catalog": args.catalog, "spec": spec.path, "num_products": len(products),
              "majority": majority[1] / len(products), "classify": {}, "describe": {}}
    index = ExemplarIndex(catalog.pool) if catalog.pool else None
    for name in filter(None, args.classify.split(",")):
        if llm is not None:
            llm.reset_prefix_cache()
        preds, wall_s, tokens, cached = [], 0.0, 0, 0
        # in chunks, with a running figure after each: a long run on a busy machine still tells
        # something when it is stopped
        for start in range(0, len(products), args.chunk):
            part = dataclasses.replace(catalog, products=products[start:start + args.chunk])
            p, w, t, c = classify_alternative(llm, part, index, name)
            preds, wall_s, tokens, cached = preds + p, wall_s + w, tokens + t, cached + c
            n = len(preds)
            acc = sum(a == b for a, b in zip(preds, truth)) / n
            print(f"classify {name:14s} accuracy {100 * acc:5.1f} % over {n:4d}   "
                  f"{1000 * wall_s / n:7.1f} ms/product   {tokens / n:6.1f} prompt tokens/product "
                  f"({cached / n:.1f} cached)", flush=True)
            report["classify"][name] = dict(accuracy=acc, num_products=n, ms_per_product=1000 * wall_s / n,
                                            prompt_tokens_per_product=tokens / n, cached_per_product=cached / n)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
    described = products[:args.num_describe or len(products)]
    rng = random.Random(args.seed)
    for name in filter(None, args.describe.split(",")):
        head, colon, overrides = name.partition(":")
        config, _, prompt_name = head.partition("+")
        user = USER_PROMPTS[prompt_name] if prompt_name else spec.describe.user_prompt
        described_spec = spec.model_copy(update={"describe": spec.describe.model_copy(update={"user_prompt": user})})
        reqs = [describe_request(p, described_spec, catalog_key(catalog)) for p in described]
        sampling = describe_config(spec, config + colon + overrides)
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([r.engine_prompt() for r in reqs], SamplingParams(**sampling))
        texts = [o.outputs[0].text.strip() for o in outs]
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        num_retried = 0
        if args.retry and spec.describe.retry_sampling:
            flagged = [i for i, x in enumerate(texts) if description_quality(x) != OK]
            num_retried = len(flagged)
            retry = SamplingParams(**{**sampling, **spec.describe.retry_sampling})
            seconds = llm.generate([reqs[i].engine_prompt() for i in flagged], retry) if flagged else []
            for i, o in zip(flagged, seconds):
                num_tokens += len(o.outputs[0].token_ids)
                texts[i] = [texts[i], o.outputs[0].text.strip()][pick_description([texts[i], o.outputs[0].text.strip()])]
        wall_s = time.perf_counter() - t
        quality = [description_quality(x) for x in texts]
        flags = Counter(quality)
        n = len(described)
        print(f"describe {name:8s} clean {100 * flags[OK] / n:5.1f} %  flags {dict(flags)}  "
              f"{f'(after a second attempt for {num_retried}) ' if args.retry else ''}"
              f"{num_tokens / n:.1f} tokens/product  {1000 * wall_s / n:.0f} ms/product  sampling {sampling}",
              flush=True)
        shown = rng.sample(range(n), min(args.show, n))
        for i in shown:
            print(f"    [{described[i].product_id}] {described[i].name!r} -> {texts[i]!r} ({quality[i]})")
        if args.flagged:
            for p, text, q in zip(described, texts, quality):
                if q != OK:
                    print(f"  flagged [{p.product_id}] {p.name!r} -> {text!r} ({q})")
        report["describe"][name] = dict(clean=flags[OK] / n, flags=dict(flags), sampling=sampling,
                                        tokens_per_product=num_tokens / n, ms_per_product=1000 * wall_s / n,
                                        texts={p.product_id: x for p, x in zip(described, texts)},
                                        shown=[dict(id=described[i].product_id, name=described[i].name,
                                                    text=texts[i], quality=quality[i]) for i in shown])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
