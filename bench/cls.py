"""W-cls benchmark: weir's choice scoring against plain transformers forward passes, same run.

Usage::

    weir bench cls [--n 256] [--batch-sizes 32] [--repeats 3] [--calibrate] [--json out.jsonl]

Each product of the catalog is one classification job: the 11 top-level categories scored as
continuations of a chat prompt (label tokens then EOS, log-probabilities summed); the answer is the
best label. Both systems score the very same token ids (weir's ``encode_prompt``/``encode_labels``).

- weir: ``LLM.classify`` (the prompt computed once per product, shared system-prompt blocks served
  by the prefix cache, one fork per label). The prefix cache is reset before every timed repeat.
- peer: transformers ``AutoModelForCausalLM`` (same GGUF, same dtype), one sequence per
  (product, label): prompt + label tokens, right-padded batches of ``--batch-sizes`` sequences in
  catalog order, no cache reuse. Right padding needs no attention mask: causal attention never lets
  a real token see the pads after it, so the real rows are exact and transformers keeps its causal
  fast path. Logits are computed only on the rows that score label tokens.

Metrics, one line each: jobs/s per system (median of ``--repeats``), top-1 accuracy against the
``category`` column, the majority baseline on those rows, weir's ratio to the best peer batch size,
the largest absolute difference of any label log-probability between the two systems and how many
answers differ, and the achieved GFLOP/s of model math against this machine's measured matmul peak
(:mod:`bench.roofline`). The peer's model loads through :func:`bench.peers.load_hf_model`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

import torch

from bench.peers import load_hf_model, pad_token_id
from bench.report import Report, cudagraph_share_line, cudagraph_shares, matmul_peak_line
from bench.roofline import FlopCounter, ModelShape, format_rate, matmul_peak
from bench.workloads import w_cls_calibration_messages, w_cls_labels, w_cls_messages


def run_weir(llm, prompts, labels, calibration, repeats):
    """``LLM.classify`` over all prompts; returns (outputs of the last repeat, median seconds)."""
    llm.classify(prompts[:2], labels, calibration_prompt=calibration)  # warm-up
    times = []
    for _ in range(repeats):
        # every repeat starts cold: only prefixes shared within the run are served from cache
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.classify(prompts, labels, calibration_prompt=calibration)
        times.append(time.perf_counter() - t)
    return outs, statistics.median(times)


def weir_flops(shape, outs, calibration) -> FlopCounter:
    """Model FLOPs weir computed: prompt tokens not served from the prefix cache, one logits row at
    the prompt's end, and the label tokens the engine reports computing (``num_label_tokens``, each
    with its logits row). Label tokens sit within a few positions of the prompt's end; their
    attention is counted at the prompt's end. The calibration prompt, when given, counts as one
    more cold prompt with the same label work."""
    fc = FlopCounter(shape)
    spans = [(o.num_prompt_tokens, o.num_cached_tokens, o.num_label_tokens) for o in outs]
    if calibration is not None and outs:
        spans.append((len(calibration), 0, outs[0].num_label_tokens))
    for num_prompt, num_cached, num_label in spans:
        fc.add_span(num_cached, num_prompt - num_cached)
        fc.add_logits(1 + num_label)
        for _ in range(num_label):
            fc.add_span(num_prompt, 1)
    return fc


def peer_scores(hf, prompts, label_ids, batch_size, pad_id) -> list[list[float]]:
    """Each label's summed log-probability after each prompt, by plain forward passes.

    Returns:
        ``scores[i][j]``: label ``j`` after prompt ``i`` (nats), float64 sums of fp32 log-probs.
    """
    # one sequence per (prompt, label): prompt + label[:-1] predicts every label token
    seqs = [(i, j) for i in range(len(prompts)) for j in range(len(label_ids))]
    scores = [[0.0] * len(label_ids) for _ in prompts]
    decoder, lm_head = hf.get_decoder(), hf.get_output_embeddings()
    for b in range(0, len(seqs), batch_size):
        batch = seqs[b:b + batch_size]
        rows = [prompts[i] + label_ids[j][:-1] for i, j in batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], device=hf.device)
        # the hidden state at position p predicts token p + 1: label tokens sit at len(prompt)..
        seq_idx, pos_idx, targets = [], [], []
        for k, (i, j) in enumerate(batch):
            start = len(prompts[i]) - 1
            for n, t in enumerate(label_ids[j]):
                seq_idx.append(k)
                pos_idx.append(start + n)
                targets.append(t)
        with torch.inference_mode():
            hidden = decoder(input_ids=ids).last_hidden_state  # [batch, width, hidden]
            logits = lm_head(hidden[seq_idx, pos_idx])  # [num_label_rows, vocab]
            lp = torch.log_softmax(logits.float(), dim=-1)
            lp = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0]
        for k, v in zip(seq_idx, lp.tolist()):
            i, j = batch[k]
            scores[i][j] += v
    return scores


def peer_flops(shape, prompts, label_ids) -> FlopCounter:
    """Model FLOPs of the peer's sequences without their padding (every label token's row gets
    logits; the padded positions are wasted work, counted by :func:`num_padded_tokens`)."""
    fc = FlopCounter(shape)
    for p in prompts:
        for ids in label_ids:
            fc.add_span(0, len(p) + len(ids) - 1)
            fc.add_logits(len(ids))
    return fc


def num_padded_tokens(prompts, label_ids, batch_size) -> int:
    lens = [len(p) + len(ids) - 1 for p in prompts for ids in label_ids]
    return sum(len(b) * max(b) - sum(b) for b in (lens[k:k + batch_size] for k in range(0, len(lens), batch_size)))


def run_peer(hf, prompts, label_ids, calibration, batch_size, pad_id, repeats):
    """Peer scoring (prior subtracted when ``calibration`` is given); (scores, median seconds)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        scores = peer_scores(hf, prompts + ([calibration] if calibration is not None else []), label_ids,
                             batch_size, pad_id)
        if calibration is not None:
            prior = scores.pop()
            scores = [[s - p for s, p in zip(row, prior)] for row in scores]
        times.append(time.perf_counter() - t)
    return scores, statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="weir bench cls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=256, help="catalog rows (256 on CPU, 4096 on GPU)")
    ap.add_argument("--model", default=None, help="GGUF file or HF folder; default packaged SmolLM2")
    ap.add_argument("--batch-sizes", default="32", help="peer batch sizes in sequences (best reported)")
    ap.add_argument("--systems", default="weir,hf-forward")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per system (median reported)")
    ap.add_argument("--calibrate", action="store_true",
                    help="subtract each label's log-prob under a content-free 'N/A' prompt (both systems)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="weir engine argument")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="weir engine argument")
    ap.add_argument("--dtype", default="float32",
                    help="both systems' dtype (float32; on CUDA bfloat16 runs weir's Triton kernels and graphs)")
    ap.add_argument("--json", default=None, help="append one JSON line per figure to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    systems = args.systems.split(",")

    from weir.engine import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024,
              measure_step_gpu_time=torch.cuda.is_available())
    labels = w_cls_labels()
    messages, truth = w_cls_messages(args.n, labels)
    prompts = [llm.encode_prompt(m) for m in messages]
    label_ids = llm.encode_labels(labels)
    calibration = llm.encode_prompt(w_cls_calibration_messages(labels)) if args.calibrate else None
    shape = ModelShape.from_config(llm.llm_engine.config)
    emit = Report(args.json, workload="W-cls", n=args.n, calibrated=args.calibrate).emit

    def accuracy(preds):
        return sum(p == t for p, t in zip(preds, truth)) / len(truth)

    peak = matmul_peak(shape, llm.llm_engine.dtype, str(llm.llm_engine.device))["peak"]
    emit(matmul_peak_line(peak), figure="matmul_peak_gflops", value=round(peak, 1))
    majority, count = Counter(truth).most_common(1)[0]
    emit(f"{'majority baseline':<24} {count / len(truth):>8.1%} ({majority})", figure="majority_baseline",
         value=round(count / len(truth), 4))
    print(f"prompts: {len(prompts)}, mean {statistics.mean(map(len, prompts)):.0f} tokens; labels: "
          f"{len(labels)}, {sum(map(len, label_ids))} tokens with EOS", flush=True)

    def report(system, secs, preds, fc, **extra):
        jobs_per_s = len(prompts) / secs
        acc = accuracy(preds)
        rate = fc.flops / secs / 1e9
        emit(f"{system:<24} {len(prompts):>6} jobs {secs:>8.2f} s {jobs_per_s:>9.2f} jobs/s "
             f"accuracy {acc:.1%}", system=system, figure="jobs_per_s", jobs=len(prompts),
             seconds=round(secs, 3), value=round(jobs_per_s, 3), accuracy=round(acc, 4),
             model_gflop=round(fc.flops / 1e9, 2), model_gflops_per_s=round(rate, 2),
             fraction_of_matmul_peak=round(rate / peak, 4), **extra)
        print(format_rate(system, fc.flops, secs, peak), flush=True)
        return jobs_per_s

    weir_rate, weir_scores, weir_preds = None, None, None
    if "weir" in systems:
        outs, secs = run_weir(llm, prompts, labels, calibration, args.repeats)
        weir_scores = [[o.logprobs[lab] for lab in labels] for o in outs]
        weir_preds = [o.label for o in outs]
        fc = weir_flops(shape, outs, calibration)
        weir_rate = report("weir", secs, weir_preds, fc, computed_tokens=fc.num_tokens,
                           prefix_cache_hit_tokens=sum(o.num_cached_tokens for o in outs))
        if llm.llm_engine.device.type == "cuda":  # every run's steps, the warm-up's included
            stats = llm.llm_engine.stats()
            emit(cudagraph_share_line(stats), figure="cudagraph_shares", value=cudagraph_shares(stats))
    if "hf-forward" in systems:
        hf = load_hf_model(args.model, llm.llm_engine.dtype, str(llm.llm_engine.device))
        pad_id = pad_token_id(llm.tokenizer)
        peer_scores(hf, prompts[:2], label_ids, 8, pad_id)  # warm-up
        fc = peer_flops(shape, prompts + ([calibration] if calibration is not None else []), label_ids)
        best = None
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            scores, secs = run_peer(hf, prompts, label_ids, calibration, bs, pad_id, args.repeats)
            preds = [labels[max(range(len(labels)), key=row.__getitem__)] for row in scores]
            padded = num_padded_tokens(prompts + ([calibration] if calibration is not None else []), label_ids, bs)
            rate = report(f"hf-forward-bs{bs}", secs, preds, fc, computed_tokens=fc.num_tokens,
                          padded_tokens=padded)
            if best is None or rate > best[0]:
                best = (rate, bs, scores, preds)
        if best is not None and weir_scores is not None:
            rate, bs, scores, preds = best
            emit(f"weir / best HF forward (hf-forward-bs{bs}): {weir_rate / rate:.2f}x",
                 figure="ratio_weir_to_peer", value=round(weir_rate / rate, 3), peer=f"hf-forward-bs{bs}")
            diff = max(abs(a - b) for wr, pr in zip(weir_scores, scores) for a, b in zip(wr, pr))
            emit(f"max |weir - peer| label log-prob: {diff:.2e} nats", figure="max_abs_logprob_diff",
                 value=diff)
            differ = sum(a != b for a, b in zip(weir_preds, preds))
            emit(f"answers that differ: {differ} of {len(preds)}", figure="num_answers_differ", value=differ)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
