"""Model load time and peak memory: weir's streamed load against transformers' ``from_pretrained``.

    python -m bench.load                 # a 1B-shape Llama (Llama-3.2-1B's shapes), bf16, 3 runs each
    python -m bench.load --small --repeat 1   # smoke: a tiny Llama

The checkpoint is random weights of Llama-3.2-1B's shapes (hidden 2048, 16 layers, intermediate
8192, 32 heads / 8 KV heads, vocab 128256, tied head: 1.24 B parameters, 2.47 GB in bf16), written
as sharded safetensors (``--shard-mb``) in a temporary folder, tensor by tensor. Each run is a fresh
Python process (so the page cache is the only thing runs share; the first run of each system reads
a file the writer just wrote, as every later one does), the systems alternating, ``--repeat`` runs
each:

- ``weir``: ``load_config``, ``LlamaForCausalLM`` built, ``load_weights(iter_weights(src))``: a
  model ready to run (the engine's load);
- ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(folder, dtype=bf16)``;
- ``old weir``: what weir did before streaming: ``from_pretrained``, then its ``state_dict()``
  copied into weir's model with ``load_weights``.

Metrics, per run: wall seconds from after the imports (torch, transformers, weir: the same for all)
to the model returned; then the seconds to read every weight once (``p.sum()``, what a first
forward pass does: transformers 5 on the CPU returns parameters that alias the memory-mapped
safetensors file when the dtype matches, so its pages are read from disk or page cache only then);
the child's peak resident set (``ru_maxrss``, which counts the mapped file's pages the process has
touched as well as its own memory) and, at the end, its anonymous resident memory (``RssAnon``: its
own copies only). Printed: every run, the medians, and weir's over each peer's (targets against
from_pretrained: time <= 0.5, peak RSS <= 0.6).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

SYSTEMS = ("weir", "from_pretrained", "old weir")

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                tie_word_embeddings=True, rope_theta=500000.0)
SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=True)


def write_checkpoint(folder: str, shape: dict, shard_bytes: int, seed: int = 0) -> int:
    """Write a random bf16 Llama of ``shape`` to ``folder`` (config, safetensors shards, index),
    one shard's tensors in memory at a time. Returns the checkpoint's bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    g = torch.Generator().manual_seed(seed)
    shards: list[dict] = [{}]
    for name, shape_ in shapes.items():
        size = 2 * int(torch.Size(shape_).numel())
        if shards[-1] and sum(2 * t.numel() for t in shards[-1].values()) + size > shard_bytes:
            _save_shard(folder, shards, save_file)
            shards.append({})
        shards[-1][name] = (torch.randn(shape_, generator=g) * 0.02).to(torch.bfloat16)
    _save_shard(folder, shards, save_file)
    names = {f"model-{i + 1:05d}.safetensors": list(s) for i, s in enumerate(shards)}
    weight_map = {name: file_name for file_name, shard in names.items() for name in shard}
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _save_shard(folder: str, shards: list[dict], save_file) -> None:
    """Write the last shard and keep only its names (its tensors freed)."""
    path = os.path.join(folder, f"model-{len(shards):05d}.safetensors")
    save_file(shards[-1], path, metadata={"format": "pt"})
    shards[-1] = dict.fromkeys(shards[-1])


def child(system: str, folder: str) -> dict:
    """Load in this process; returns ``{"wall_s", "max_rss_bytes", "num_params"}``."""
    import resource

    import safetensors.torch  # noqa: F401  (imported before the clock starts, by every system alike)
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (transformers imports it lazily)
    from transformers import AutoModelForCausalLM

    from weir.engine.loader import load_config
    from weir.engine.models.llama import LlamaForCausalLM
    from weir.engine.weight_loader import iter_weights, no_init_weights
    from weir.model_source import resolve_model

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    started = time.perf_counter()
    if system == "weir":
        src = resolve_model(folder)
        config = load_config(src)
        with no_init_weights():
            model = LlamaForCausalLM(config, torch.bfloat16, 2048)
        model.load_weights(iter_weights(src, config))
    else:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        model = hf
        if system == "old weir":
            model = LlamaForCausalLM(hf.config, torch.bfloat16, 2048)
            model.load_weights(hf.state_dict().items())
    model.eval()
    wall_s = time.perf_counter() - started
    started = time.perf_counter()
    with torch.no_grad():  # every weight read once, as a first forward pass reads it
        for p in model.parameters():
            p.sum()
    read_s = time.perf_counter() - started
    return {"wall_s": wall_s, "read_s": read_s,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_anon_bytes": rss_anon_bytes(), "num_params": sum(p.numel() for p in model.parameters())}


def rss_anon_bytes() -> int:
    """This process's resident anonymous memory (its own, not a mapped file's pages: ``RssAnon`` of
    ``/proc/self/status``); 0 where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


METRICS = ("wall_s", "read_s", "max_rss_bytes", "rss_anon_bytes")


def describe(r: dict) -> str:
    return (f"load {r['wall_s']:6.2f} s, then every weight read {r['read_s']:5.2f} s; peak RSS "
            f"{r['max_rss_bytes'] / 2**30:5.2f} GiB, anonymous {r['rss_anon_bytes'] / 2**30:5.2f} GiB")


def run_child(system: str, folder: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.load", "--child", system, "--dir", folder],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a tiny Llama (smoke test)")
    ap.add_argument("--shard-mb", type=int, default=1024, help="safetensors shard size (MB)")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return 0

    with tempfile.TemporaryDirectory(prefix="weir-load-") as folder:
        shape = SMALL if args.small else LLAMA_1B
        num_bytes = write_checkpoint(folder, shape, args.shard_mb << 20)
        num_shards = len([f for f in os.listdir(folder) if f.endswith(".safetensors")])
        print(f"checkpoint: Llama {'small' if args.small else '1B-shape'}, bf16, {num_bytes / 1e9:.3f} GB "
              f"in {num_shards} safetensors shards; {args.repeat} fresh processes per system, alternating")
        runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
        for i in range(args.repeat):
            for system in SYSTEMS:
                r = run_child(system, folder)
                runs[system].append(r)
                print(f"  run {i + 1} {system:>15}: {describe(r)}")
        median = {s: {k: statistics.median(r[k] for r in runs[s]) for k in METRICS} for s in SYSTEMS}
        for s in SYSTEMS:
            print(f"median {s:>15}: {describe(median[s])}")
        for peer in SYSTEMS[1:]:
            mine, theirs = median["weir"], median[peer]
            load = mine["wall_s"] / max(theirs["wall_s"], 1e-9)
            load_read = (mine["wall_s"] + mine["read_s"]) / max(theirs["wall_s"] + theirs["read_s"], 1e-9)
            rss = mine["max_rss_bytes"] / theirs["max_rss_bytes"]
            print(f"weir / {peer}: load time {load:.2f}, load + read time {load_read:.2f}, peak RSS {rss:.2f} "
                  "(targets against from_pretrained: time <= 0.5, peak RSS <= 0.6)")
        num_params = {r["num_params"] for s in SYSTEMS for r in runs[s]}
        print(f"parameters per model: {sorted(num_params)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
