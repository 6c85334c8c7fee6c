"""Attention backends on one mixed step: what each derives from the common step inputs (exact
values), and their output against a token-by-token softmax over the paged cache."""

import pytest
import torch

from weir.engine.attention import (
    CpuAttentionBackend, TorchAttentionBackend, get_attention_backend, select_attention_backend,
)
from weir.engine.step_inputs import build_step_inputs
from weir.kernels.cpu_paged_attention import is_available as cpu_kernel_available
from weir.engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.engine.steps import Req
from tests.engine.test_step_inputs import CPU, mixed_step

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 8, 8


def naive_attention(query, key_cache, value_cache, inputs, block_size, window=None):
    """Each packed token's softmax over positions ``0..position`` of its request (with a window
    ``W``: ``position - W + 1..position``), read slot by slot through the request's block table, in
    float64."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    qpk = NUM_HEADS // NUM_KV_HEADS
    flat_k = key_cache.double().reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    flat_v = value_cache.double().reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    row = 0
    for s in inputs.requests:
        r = s.request
        for p in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
            first = 0 if window is None else max(p - window + 1, 0)
            slots = [r.block_table[j // block_size] * block_size + j % block_size for j in range(first, p + 1)]
            for h in range(NUM_HEADS):
                k, v = flat_k[h // qpk, slots], flat_v[h // qpk, slots]
                w = torch.softmax(k @ query[row, h].double() * HEAD_DIM ** -0.5, 0)
                out[row, h] = w @ v
            row += 1
    return out


def run_backend(backend, block_size, device=CPU, dtype=torch.float32, sched=None, num_blocks=NUM_BLOCKS,
                window=None, nan_block=None):
    """The mixed step (or ``sched``) through ``backend``: write its keys/values into a random cache,
    attend (with ``window``). ``nan_block``: that block of the cache is filled with NaN."""
    sched = sched or mixed_step()
    g = torch.Generator().manual_seed(0)
    shape = (NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM)
    key_cache = torch.randn(shape, generator=g).to(device, dtype)
    value_cache = torch.randn(shape, generator=g).to(device, dtype)
    if nan_block is not None:
        key_cache[:, nan_block] = value_cache[:, nan_block] = float("nan")
    inputs = build_step_inputs(sched, block_size, device, backend.index_dtype)
    t = sched.num_tokens
    q = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    meta = backend.build_metadata(inputs)
    backend.write_kv(k, v, key_cache, value_cache, meta)
    out = backend.forward(q, k, v, key_cache, value_cache, meta, HEAD_DIM ** -0.5, sliding_window=window)
    return out, naive_attention(q.cpu(), key_cache.cpu(), value_cache.cpu(), inputs, block_size, window)


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


WINDOW, NAN_BLOCK = 5, 19


def windowed_step(block_size: int = 4) -> SchedulerOutput:
    """A step whose contexts outrun a window of 5 (block size 4 or 8): a decode at position 13, a
    fresh 9-token prompt, a 3-token chunk over 10 cached tokens, a 17-token chunk over 12 (past the
    CPU kernel's chunk limit). Block-table entries wholly before every query's window name block
    19, which the tests fill with NaN: a backend that reads one gives NaN."""
    n = NAN_BLOCK
    tables = {  # a: keys 9..13; c: from key 6; d: from key 8
        4: ([n, n, 2, 3], [4, 5, 6], [n, 7, 8, 9], [n, n, 10, 11, 12, 13, 14, 15]),
        8: ([n, 2], [4, 5], [7, 8], [n, 10, 11, 12]),
    }[block_size]
    a = Req(list(range(100, 114)), tables[0], 13)
    b = Req(list(range(120, 129)), tables[1], 0)
    c = Req(list(range(130, 143)), tables[2], 10)
    d = Req(list(range(150, 179)), tables[3], 12)
    return SchedulerOutput([ScheduledRequest(b, 9), ScheduledRequest(c, 3), ScheduledRequest(a, 1),
                            ScheduledRequest(d, 17)])


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_sliding_window_equals_naive_softmax_and_never_reads_blocks_before_it(name):
    if name == "cpu" and not cpu_kernel_available():
        pytest.skip("the CPU attention kernel could not be built")
    backend = get_attention_backend(name)
    out, want = run_backend(backend, 4, sched=windowed_step(), num_blocks=20, window=WINDOW, nan_block=NAN_BLOCK)
    assert not want.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # the same step without the window reads the NaN block
    out, _ = run_backend(backend, 4, sched=windowed_step(), num_blocks=20, nan_block=NAN_BLOCK)
    assert out.isnan().any()


def test_torch_backend_windowed_context_exact_values():
    inputs = build_step_inputs(windowed_step(), 4, CPU, torch.int64)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(inputs)
    decodes, context = backend._window(meta, WINDOW, 4)
    # the decode's blocks from block 2 on; the chunks' from blocks 1 and 2 on (ragged: padding block 0)
    assert decodes.block_table.tolist() == [[2, 3]]
    assert decodes.mask[0, 0, 0].tolist() == [False] + [True] * 5 + [False] * 2  # positions 8..15: 9..13
    assert context.block_table.tolist() == [[7, 8, 9, 0, 0, 0], [10, 11, 12, 13, 14, 15]]
    # chunk C: query 10 sees 6..10 (columns from position 4), query 12 sees 8..12; its 14 padding
    # queries see what query 10 sees
    assert context.mask[0, 0, 0].nonzero().flatten().tolist() == [2, 3, 4, 5, 6]
    assert context.mask[0, 0, 2].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    assert context.mask[0, 0, 16].nonzero().flatten().tolist() == [2, 3, 4, 5, 6]
    # chunk D: query 28 sees 24..28 (columns from position 8)
    assert context.mask[1, 0, 16].nonzero().flatten().tolist() == [16, 17, 18, 19, 20]
    assert backend._window(meta, WINDOW, 4)[0] is decodes  # built once per window


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton backend on CUDA (on CPU: tests/kernels)")
def test_triton_backend_on_cuda_with_a_window_equals_naive_softmax():
    out, want = run_backend(get_attention_backend("triton"), 4, torch.device("cuda"), torch.float16,
                            sched=windowed_step(), num_blocks=20, window=WINDOW, nan_block=NAN_BLOCK)
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-3, rtol=2e-3)
