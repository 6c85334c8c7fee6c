"""Attention backends on one mixed step: what each derives from the common step inputs (exact
values), and their output against a token-by-token softmax over the paged cache."""

import pytest
import torch

from weir.engine.attention import (
    CpuAttentionBackend, TorchAttentionBackend, get_attention_backend, select_attention_backend,
)
from weir.engine.step_inputs import build_step_inputs
from weir.kernels.cpu_paged_attention import is_available as cpu_kernel_available
from tests.engine.test_step_inputs import CPU, mixed_step

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 8, 8


def naive_attention(query, key_cache, value_cache, inputs, block_size):
    """Each packed token's softmax over positions ``0..position`` of its request, read slot by
    slot through the request's block table, in float64."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    qpk = NUM_HEADS // NUM_KV_HEADS
    flat_k = key_cache.double().reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    flat_v = value_cache.double().reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    row = 0
    for s in inputs.requests:
        r = s.request
        for p in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
            slots = [r.block_table[j // block_size] * block_size + j % block_size for j in range(p + 1)]
            for h in range(NUM_HEADS):
                k, v = flat_k[h // qpk, slots], flat_v[h // qpk, slots]
                w = torch.softmax(k @ query[row, h].double() * HEAD_DIM ** -0.5, 0)
                out[row, h] = w @ v
            row += 1
    return out


def run_backend(backend, block_size, device=CPU, dtype=torch.float32):
    """The mixed step through ``backend``: write its keys/values into a random cache, attend."""
    g = torch.Generator().manual_seed(0)
    shape = (NUM_KV_HEADS, NUM_BLOCKS, block_size, HEAD_DIM)
    key_cache = torch.randn(shape, generator=g).to(device, dtype)
    value_cache = torch.randn(shape, generator=g).to(device, dtype)
    inputs = build_step_inputs(mixed_step(), block_size, device, backend.index_dtype)
    q = torch.randn(10, NUM_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    k = torch.randn(10, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    v = torch.randn(10, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    meta = backend.build_metadata(inputs)
    backend.write_kv(k, v, key_cache, value_cache, meta)
    out = backend.forward(q, k, v, key_cache, value_cache, meta, HEAD_DIM ** -0.5)
    return out, naive_attention(q.cpu(), key_cache.cpu(), value_cache.cpu(), inputs, block_size)


def test_torch_backend_metadata():
    inputs = build_step_inputs(mixed_step(), 4, CPU, torch.int64)
    meta = TorchAttentionBackend().build_metadata(inputs)
    d, c = meta.decodes, meta.context_prefills
    assert (d.first, d.num_seqs, d.block_table.tolist()) == (0, 1, [[7, 2]])
    assert d.mask.tolist() == [[[[True] * 6]]]
    assert c.rows.tolist() == [[1, 2, 0, 0], [3, 4, 5, 6]]
    assert c.valid.tolist() == [[True, True, False, False], [True] * 4]
    assert c.block_table.tolist() == [[6, 0], [5, 1]]
    # chunk D (prefix 2) query i sees positions <= 2 + i; chunk C (prefix 4) <= 4 + i
    visible = c.mask[:, 0].sum(-1).tolist()
    assert visible == [[3, 4, 1, 1], [5, 6, 7, 8]]
    assert meta.prefills == [(7, 3)]


def test_cpu_backend_takes_decodes_and_short_prefix_chunks():
    inputs = build_step_inputs(mixed_step(), 4, CPU, torch.int64)
    meta = CpuAttentionBackend().build_metadata(inputs)
    v = meta.varlen
    assert (v.num_tokens, v.max_ctx, v.block_table.tolist()) == (7, 8, [[7, 2], [6, 0], [5, 1]])
    assert v.token_seq.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert v.token_ctx.tolist() == [6, 3, 4, 5, 6, 7, 8]
    assert (meta.decodes, meta.context_prefills, meta.prefills) == (None, None, [(7, 3)])


def test_cpu_backend_leaves_long_prefix_chunks_to_sdpa():
    sched = mixed_step()
    sched.scheduled[1].request.all_token_ids = list(range(100, 130))
    sched.scheduled[1].request.block_table = [5, 1, 4, 3, 0, 6]
    sched.scheduled[1].num_new_tokens = 17  # over MAX_KERNEL_CHUNK: positions 4..20
    inputs = build_step_inputs(sched, 4, CPU, torch.int64)
    meta = CpuAttentionBackend().build_metadata(inputs)
    assert meta.varlen.token_seq.tolist() == [0, 1, 1]
    assert meta.context_prefills.rows[0].tolist() == list(range(3, 20))
    assert meta.prefills == [(20, 3)]


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_backend_output_equals_naive_softmax(name):
    if name == "cpu" and not cpu_kernel_available():
        pytest.skip("the CPU attention kernel could not be built")
    out, want = run_backend(get_attention_backend(name), 4)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_backend_chosen_by_device_and_dtype():
    assert select_attention_backend(CPU, torch.bfloat16).name == "torch"
    want = "cpu" if cpu_kernel_available() else "torch"
    assert select_attention_backend(CPU, torch.float32).name == want
    assert select_attention_backend(torch.device("cuda"), torch.bfloat16).name == "triton"
    assert select_attention_backend(torch.device("cuda"), torch.float32).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton backend on CUDA (on CPU: tests/kernels)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_backend_on_cuda_equals_naive_softmax(dtype):
    out, want = run_backend(get_attention_backend("triton"), 8, torch.device("cuda"), dtype)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
