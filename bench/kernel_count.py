"""Kernels one decoder layer launches on the Triton path, counted on CPU, before and after a change.

One decoder layer, and the forward of a one-layer model, run once on a mixed step (one decode,
three prefill chunks: both attention kernels run) of a tiny random Llama in fp32, with the Triton
backend and its kernels under Triton's CPU interpreter. A ``TorchDispatchMode`` sees every aten op; Triton launches are counted at the
launcher (``JITFunction.run``, or the interpreter's), with the aten ops the interpreter itself runs
inside a launch left out. Ops split into *kernels* (aten ops that compute, plus Triton launches:
what a GPU would launch), *views* (no data moves) and *allocations* (``empty*``).

Usage::

    TRITON_INTERPRET=1 python -m bench.kernel_count [--before 95ed8dc]

prints the counts of this tree, of ``--before`` (a git revision, exported with ``git archive`` and
imported in a child process) and their ratio, per layer and per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOCATIONS = ("aten.empty", "aten.empty_like", "aten.empty_strided")


class OpCounter:
    """Counts aten ops (``TorchDispatchMode``) and Triton launches while active; ``kernels``,
    ``views`` and ``allocations`` are ``Counter``s of op names."""

    def __init__(self):
        self.kernels, self.views, self.allocations = Counter(), Counter(), Counter()
        self._in_launch = 0

    def record(self, func) -> None:
        if self._in_launch:
            return
        name = str(func.overloadpacket)
        if name in ALLOCATIONS:
            self.allocations[name] += 1
        elif func.is_view:
            self.views[name] += 1
        else:
            self.kernels[name] += 1

    @contextlib.contextmanager
    def counting(self, launcher_class):
        """Count inside the block; ``launcher_class`` is the class of a ``@triton.jit`` kernel."""
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.record(func)
                return func(*args, **(kwargs or {}))

        run = launcher_class.run

        def counted_run(fn, *args, **kwargs):
            if not counter._in_launch:
                counter.kernels[f"triton.{fn.fn.__name__}"] += 1
            counter._in_launch += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter._in_launch -= 1

        launcher_class.run = counted_run
        try:
            with Mode():
                yield self
        finally:
            launcher_class.run = run

    def summary(self) -> dict:
        return {"kernels": dict(self.kernels), "views": dict(self.views),
                "allocations": dict(self.allocations)}


def count_ops() -> dict:
    """Counts on the Triton path, as ``LlamaForCausalLM.use_kernels(True)`` (or, before it,
    ``use_norm_kernel``) sets it: ``layer``, one decoder layer (its input norm the fused residual
    add + norm); ``step``, the forward of the whole one-layer model (embedding, the per-step work
    outside the layers, the layer with a plain input norm, the final norm)."""
    import torch
    from transformers import LlamaConfig

    from tests.engine.test_step_inputs import mixed_step
    from weir.engine.attention import TritonAttentionBackend
    from weir.engine.models import llama
    from weir.engine.step_inputs import build_step_inputs
    from weir.kernels.rms_norm import _rms_norm_kernel

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = llama.LlamaForCausalLM(cfg, torch.float32, 64)
    model.init_dummy()
    (model.use_kernels if hasattr(model, "use_kernels") else model.use_norm_kernel)(True)
    layer = model.layers[0]
    backend = TritonAttentionBackend()
    block_size = 8
    inputs = build_step_inputs(mixed_step(), block_size, torch.device("cpu"), backend.index_dtype)
    meta = backend.build_metadata(inputs)
    kc, vc = torch.zeros(2, 2, 8, block_size, 16).unbind(0)
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, inputs.num_tokens, 64, generator=g).unbind(0)
    pos = inputs.positions
    if getattr(layer, "rotary", None) not in (None, getattr(llama, "apply_rotary", None)):
        args = (pos, model.cos_cache, model.sin_cache)  # the kernel gathers by position
    else:  # the torch rotary reads each token's rows, gathered once per step by forward
        cos, sin = model.cos_cache[pos].unsqueeze(1), model.sin_cache[pos].unsqueeze(1)
        args = (pos, cos, sin) if hasattr(model, "use_kernels") else (cos, sin)
    layer_counter, step_counter = OpCounter(), OpCounter()
    with torch.inference_mode():
        with layer_counter.counting(type(_rms_norm_kernel)):
            layer(x, residual, *args, kc, vc, backend, meta)
        with step_counter.counting(type(_rms_norm_kernel)):
            model(inputs.input_ids, pos, [(kc, vc)], backend, meta)
    return {"layer": layer_counter.summary(), "step": step_counter.summary()}


def before_ops(rev: str) -> dict:
    """:func:`count_ops` of git revision ``rev``, run in a child process that imports ``weir``
    from a ``git archive`` of it (its folders linked under ``weir/`` as setuptools maps them)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, pkg = os.path.join(tmp, "src"), os.path.join(tmp, "pkg", "weir")
        os.makedirs(src)
        os.makedirs(os.path.dirname(pkg))
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        os.symlink(os.path.join(src, "weir"), pkg)
        for part in ("engine", "kernels"):
            os.symlink(os.path.join(src, part), os.path.join(src, "weir", part))
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(pkg)!r}); import json, weir; "
                f"assert weir.__file__.startswith({tmp!r}), weir.__file__; "
                "from bench.kernel_count import count_ops; print(json.dumps(count_ops()))")
        env = dict(os.environ, TRITON_INTERPRET="1")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="95ed8dc", help="git revision of the 'before' code")
    args = parser.parse_args()
    if not os.environ.get("TRITON_INTERPRET"):
        sys.exit("run with TRITON_INTERPRET=1 (the counts are of the CPU interpreter run)")
    results = {"before " + args.before: before_ops(args.before), "after": count_ops()}
    for scope in ("layer", "step"):
        print(f"{scope}:")
        for label, r in results.items():
            totals = {k: sum(v.values()) for k, v in r[scope].items()}
            print(f"  {label:>15}: {totals['kernels']} kernels, {totals['views']} views, "
                  f"{totals['allocations']} allocations")
            print(f"  {'':>15}  kernels {dict(sorted(r[scope]['kernels'].items()))}")
        b, a = (sum(r[scope]["kernels"].values()) for r in results.values())
        print(f"  kernels after/before: {a}/{b} = {a / b:.2f}")


if __name__ == "__main__":
    main()
