"""The same extraction workload with and without structured outputs, in one run.

Usage::

    python -m bench.structured [--products 64] [--max-tokens 64] [--repeats 3] [--catalog CSV]

W-extract: per catalog product, a chat prompt asking for its attributes as JSON (brand, quantity,
unit, pack size), greedy, ``max_tokens`` 64. "constrained" adds
``structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)``;
"unconstrained" runs the same prompts for the same number of tokens each (``max_tokens`` = that
request's constrained output length, ``ignore_eos``), so that both generate the same tokens at the
same context lengths and the difference is the grammar's cost; "free" is the prompts as they are
(the model writes prose to the cap). The systems alternate within each repeat on one engine;
figures are medians: generated tokens/s (the throughput the target is stated in), requests/s,
outputs that parse as JSON and validate against the schema, and the share that finished (``stop``). Grammar compile
time is measured on a fresh ``StructuredOutputManager``: the first compile (with the tokenizer's
vocabulary table, built once per engine) and a cached lookup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.workloads import DEFAULT_CATALOG, catalog_rows

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["brand", "quantity", "unit", "pack_size"],
    "properties": {
        "brand": {"type": "string", "maxLength": 40},
        "quantity": {"type": "number", "minimum": 0},
        "unit": {"enum": ["g", "kg", "ml", "l", "pcs", "none"]},
        "pack_size": {"type": "integer", "minimum": 1, "maximum": 100},
    },
}
SYSTEM = ("Extract the product's attributes as JSON with the keys brand, quantity, unit "
          "(g, kg, ml, l, pcs or none) and pack_size (items in the pack).")


def messages(n: int, path: str) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Product: {r['product']}\nBrand: {r['brand']}"}]
            for r in catalog_rows(n, path)]


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_once(llm, prompts, params) -> dict:
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    comps = [o.outputs[0] for o in outs]
    tokens = sum(len(c.token_ids) for c in comps)
    return {"wall_s": wall, "tok_s": tokens / wall, "req_s": len(comps) / wall,
            "valid": sum(valid(c.text) for c in comps) / len(comps),
            "stop": sum(c.finish_reason == "stop" for c in comps) / len(comps),
            "tokens": tokens}


def compile_times(llm) -> tuple[float, float, float]:
    """(first compile incl. the vocabulary table, first compile of a second schema, cached lookup), seconds."""
    from weir.engine.sampling_params import StructuredOutputsParams
    from weir.engine.structured_outputs import StructuredOutputManager

    eng = llm.llm_engine
    manager = StructuredOutputManager(eng.tokenizer, eng.config.vocab_size, eng.eos_token_ids)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    t0 = time.perf_counter()
    manager.compile(spec)
    t1 = time.perf_counter()
    manager.compile(StructuredOutputsParams(json={**SCHEMA, "required": ["brand"]}, disable_any_whitespace=True))
    t2 = time.perf_counter()
    manager.compile(StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--products", type=int, default=64, help="catalog rows, one request each")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each system")
    ap.add_argument("--catalog", default=DEFAULT_CATALOG, help="catalog CSV (BigBasket columns)")
    ap.add_argument("--dtype", default="auto", help="engine dtype")
    args = ap.parse_args(argv)

    from weir.engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(None, dtype=args.dtype, max_model_len=1024)
    prompts = [llm.encode_prompt(m) for m in messages(args.products, args.catalog)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    llm.generate(prompts[:4], free)  # warm-up (and the engine's first grammar compile below)
    llm.generate(prompts[:4], constrained)
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained)]
    matched = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs: dict[str, list[dict]] = {"constrained": [], "unconstrained": [], "free": []}
    for _ in range(args.repeats):
        runs["constrained"].append(run_once(llm, prompts, constrained))
        runs["unconstrained"].append(run_once(llm, prompts, matched))
        runs["free"].append(run_once(llm, prompts, free))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"W-extract: {args.products} products, greedy, max_tokens={args.max_tokens}, "
          f"{args.repeats} alternating repeats (medians), device={llm.llm_engine.device}")
    print(f"{'system':14s} {'tok/s':>8s} {'req/s':>7s} {'tokens':>7s} {'valid':>6s} {'stop':>6s}")
    for name, m in med.items():
        print(f"{name:14s} {m['tok_s']:8.1f} {m['req_s']:7.2f} {m['tokens']:7.0f} {m['valid']:6.1%} {m['stop']:6.1%}")
    u, c = med["unconstrained"], med["constrained"]
    print(f"constrained / unconstrained: tokens/s {c['tok_s'] / u['tok_s']:.3f}, requests/s {c['req_s'] / u['req_s']:.3f}")
    first, second, cached = compile_times(llm)
    print(f"grammar compile: first {first * 1e3:.1f} ms (with the vocabulary table), another schema "
          f"{second * 1e3:.1f} ms, cached {cached * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
