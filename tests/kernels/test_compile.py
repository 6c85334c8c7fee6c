"""Every Triton kernel compiles for a CUDA GPU (sm_90, to PTX and a cubin), with no GPU present.

The other kernel tests run the kernels under Triton's CPU interpreter, which executes the Python
body and so never sees what only the compiler checks (a loop-carried value that changes type, an
argument a call between ``@triton.jit`` functions cannot pass, an op with no lowering). Compilation runs in a child process because
the interpreter setting is read when a kernel is decorated and this process has it on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.kernels.support import import_kernel

import_kernel("common")

# index pointers of each kernel; every other ``*_ptr`` is a float tensor of the model dtype
INDEX_POINTERS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                  "slot_mapping_ptr": "*i32", "positions_ptr": "*i32"}  # the Triton backend passes int32 step inputs
FLOAT_SCALARS = ("scale_log2", "eps")

# (module, kernel, constexprs as the wrapper picks them for head_dim 128, 4 query heads per KV
# head, block_size 16, hidden size 2048, bf16); a module's LAUNCH_OPTIONS, if it has them, are the
# compiler options its wrapper launches with
KERNELS = [
    ("paged_attention", "_paged_decode_kernel",
     dict(QUERIES_PER_KV=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64,
          UPCAST=False, IEEE=False)),
    ("prefill_attention", "_prefill_kernel",
     dict(QUERIES_PER_KV=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=32,
          UPCAST=False, IEEE=False)),
    ("kv_cache", "_write_kv_kernel", dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16)),
    ("rms_norm", "_rms_norm_kernel", dict(HIDDEN=2048, BLOCK=2048, HAS_RESIDUAL=True)),
    # 32 query + 8 KV heads
    ("rotary", "_rotary_kernel", dict(NUM_HEADS=40, HALF=64, BLOCK_H=64, BLOCK_HALF=64)),
    ("activation", "_silu_and_mul_kernel", dict(D=5632, BLOCK=1024, LIBDEVICE=True)),
]


def compile_for_cuda(module: str, kernel: str, constexprs: dict, arch: int = 90) -> str:
    """Compile ``weir.kernels.<module>.<kernel>`` for ``sm_<arch>`` with bf16 tensors; returns
    the PTX. Needs ``TRITON_INTERPRET`` unset when the module is imported."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = importlib.import_module(f"weir.kernels.{module}")
    fn = getattr(mod, kernel)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = INDEX_POINTERS.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                              options=getattr(mod, "LAUNCH_OPTIONS", None))
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    return compiled.asm["ptx"]


def compile_all() -> None:
    """Compile every kernel of ``KERNELS``; print one JSON line: kernel name -> its PTX, or the
    compiler's error."""
    import traceback

    results = {}
    for module, kernel, constexprs in KERNELS:
        try:
            results[kernel] = compile_for_cuda(module, kernel, constexprs)
        except Exception:
            results[kernel] = "error: " + traceback.format_exc()[-3000:]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """PTX (or error) per kernel, compiled in one child process without the interpreter."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton"))  # no kernel from earlier runs
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "from tests.kernels.test_compile import compile_all; compile_all()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("kernel", [k[1] for k in KERNELS])
def test_kernel_compiles_for_sm90(compiled, kernel):
    assert f".entry {kernel}" in compiled[kernel], compiled[kernel]


def test_rotary_rounds_every_product_and_sum(compiled):
    """No fused multiply-add in the bf16 rotary kernel: each product and each sum is rounded to
    bf16 on its own, as eager torch rounds them, which is what makes it bit-identical on the GPU."""
    ptx = compiled["_rotary_kernel"]
    assert "mul.rn.bf16" in ptx and "add.rn.bf16" in ptx, ptx[-2000:]
    assert "fma" not in ptx
