"""Categories by the cheapest method that is as good: a kNN vote, the LLM, or both, with a review
threshold chosen on tuning rows and reported on held-out ones.

    python -m bench.categories [--catalogs bigbasket,flipkart] [--num 400]

Per catalog, ``--num`` products (seed 25) from the second half of the file, split alternately
into tuning and held-out rows. The labels and ground truth are the spec's (the catalog's own
column at its taxonomy level); the labelled pool is the whole file (each product's own row and
rows with its title are never its neighbours, :mod:`weir.jobs.catalog.exemplars`).

- ``knn``: no model; the label with the largest summed TF-IDF similarity over the 10 nearest
  labelled products; confidence = that label's share of the vote.
- ``llm``: the catalog job's classification (:func:`weir.jobs.catalog.enrichment.classify_request`
  with the spec's ``num_exemplars`` nearest as few-shot lines) with the packaged SmolLM2-135M;
  confidence = the chosen label's probability.
- ``hybrid``: ``knn`` where its vote share is at least the threshold that gives 95 % precision on
  the tuning rows, ``llm`` (and its probability) elsewhere; its cost counts the LLM only there.

Printed per method: accuracy on the held-out rows, seconds per 1,000 products (wall time of the
vote or of the engine's ``classify`` over all rows, prompts encoded outside it), and the review
threshold chosen on the tuning rows (the lowest confidence at which the rows at or above it are
at least ``--precision`` right), with the held-out precision of ``auto`` categories and their share.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time
from typing import Optional

from bench.grounding_sample import DATA, FILES, SEED

KNN_K = 10


def threshold_for(confidence: list[float], correct: list[bool], precision: float) -> Optional[float]:
    """The lowest confidence ``t`` such that the rows with confidence >= ``t`` are at least
    ``precision`` right (None: no such ``t``)."""
    best = None
    for t in sorted(set(confidence), reverse=True):
        chosen = [c for conf, c in zip(confidence, correct) if conf >= t]
        if sum(chosen) >= precision * len(chosen):
            best = t
    return best


def held_out(confidence, correct, t):
    chosen = [c for conf, c in zip(confidence, correct) if t is not None and conf >= t]
    return (sum(chosen) / len(chosen) if chosen else None), len(chosen) / len(correct)


def run(catalog_name: str, num: int, precision: float, llm) -> None:
    from weir.jobs.catalog.enrichment import category_votes, classify_request, read_catalog
    from weir.jobs.catalog.exemplars import ExemplarIndex
    from weir.jobs.catalog.spec import load_spec

    spec = load_spec(catalog_name)
    catalog = read_catalog(os.path.join(DATA, FILES[catalog_name]), spec)
    half = [p for p in catalog.products[len(catalog.products) // 2:] if p.category]
    products = random.Random(SEED).sample(half, min(num, len(half)))
    truth = [p.category for p in products]
    index = ExemplarIndex(catalog.pool)

    started = time.perf_counter()
    knn = dataclasses.replace(catalog, spec=spec.model_copy(update={"classify": spec.classify.model_copy(
        update={"method": "knn", "num_neighbours": KNN_K})}))
    votes = category_votes(knn, products, index)  # the job's own vote (method = "knn")
    knn_label = [votes[p.product_id].label or catalog.labels[0] for p in products]
    knn_conf = [votes[p.product_id].share for p in products]
    knn_s = time.perf_counter() - started

    requests = [classify_request(p, catalog, index.nearest(p.product_id, p.name, p.brand, spec.classify.num_exemplars))
                for p in products]
    prompts = [llm.encode_prompt(r.engine_prompt()) for r in requests]
    started = time.perf_counter()
    outs = llm.classify(prompts, requests[0].labels, requests[0].label_texts)
    llm_s = time.perf_counter() - started
    llm_label = [o.label for o in outs]
    llm_conf = [o.probs[o.label] for o in outs]

    tune = list(range(0, len(products), 2))
    test = list(range(1, len(products), 2))

    def pick(values, rows):
        return [values[i] for i in rows]

    knn_ok = [a == b for a, b in zip(knn_label, truth)]
    llm_ok = [a == b for a, b in zip(llm_label, truth)]
    t_vote = threshold_for(pick(knn_conf, tune), pick(knn_ok, tune), precision)
    use_knn = [t_vote is not None and c >= t_vote for c in knn_conf]
    hybrid_ok = [k if u else m for k, m, u in zip(knn_ok, llm_ok, use_knn)]
    hybrid_conf = [k if u else m for k, m, u in zip(knn_conf, llm_conf, use_knn)]
    share_llm = 1 - sum(use_knn) / len(use_knn)
    methods = {"knn": (knn_ok, knn_conf, knn_s), "llm": (llm_ok, llm_conf, llm_s + knn_s),  # the exemplars are the same lookup
               "hybrid": (hybrid_ok, hybrid_conf, knn_s + llm_s * share_llm)}
    print(f"{catalog_name}: {len(products)} products ({len(tune)} tuning, {len(test)} held out), "
          f"{len(catalog.labels)} labels; hybrid: the vote where its share >= {t_vote} "
          f"(LLM on {100 * share_llm:.0f} % of rows)")
    for name, (ok, conf, seconds) in methods.items():
        t = threshold_for(pick(conf, tune), pick(ok, tune), precision)
        p_auto, share = held_out(pick(conf, test), pick(ok, test), t)
        accuracy = sum(pick(ok, test)) / len(test)
        shown = "–" if p_auto is None else f"{100 * p_auto:.1f} %"
        print(f"  {name:7s} accuracy {100 * accuracy:5.1f} %  {1000 * seconds / len(products):8.1f} s/1000 products  "
              f"review below {t if t is None else round(t, 4)}: precision of auto {shown}, auto {100 * share:.1f} %")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalogs", default="bigbasket,flipkart")
    ap.add_argument("--num", type=int, default=400)
    ap.add_argument("--precision", type=float, default=0.95)
    args = ap.parse_args(argv)
    from weir.engine import LLM

    llm = LLM(None, max_model_len=2048)
    for name in args.catalogs.split(","):
        run(name, args.num, args.precision, llm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
