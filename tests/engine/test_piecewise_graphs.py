"""Piecewise CUDA graphs on CPU, built with ``capture=False`` (the same static buffers, padding and
piece boundaries; each piece runs eagerly where the GPU replays it): hidden states and caches equal
to the eager forward, padding that never reaches the cache, the full/piecewise/eager dispatch, the
per-mode step counters, and no op but attention between the pieces."""

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # read when a kernel is decorated, before any is imported
    os.environ["TRITON_INTERPRET"] = "1"

from weir.engine.attention import TorchAttentionBackend  # noqa: E402
from weir.engine.cuda_graphs import EAGER, FULL, PIECEWISE, CUDAGraphMode, build_cuda_graphs, dispatch  # noqa: E402
from weir.engine.engine_args import EngineArgs  # noqa: E402
from weir.engine.piecewise_graphs import PiecewiseGraphs, piecewise_capture_sizes, resolve_capture_sizes  # noqa: E402
from weir.engine.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from weir.engine.step_inputs import build_step_inputs  # noqa: E402
from tests.engine.steps import Req, mixed_step  # noqa: E402

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS = 4, 12


def five_token_step() -> SchedulerOutput:
    """5 tokens: decode A, chunk D of 2, the first 2 tokens of fresh prompt B."""
    s = mixed_step().scheduled
    return SchedulerOutput([ScheduledRequest(s[2].request, 1), ScheduledRequest(s[3].request, 2),
                            ScheduledRequest(s[0].request, 2)])


def classification_step() -> SchedulerOutput:
    """13 tokens: four label forks computing 3 label tokens each over a shared 6-token prompt
    (block 1 shared, each fork's later blocks its own), and one decode."""
    prompt = [50, 51, 52, 53, 54, 55]
    forks = [ScheduledRequest(Req(prompt + [60 + i, 70 + i, 80 + i], [1, 2 + i, 8 + i], 6), 3) for i in range(4)]
    return SchedulerOutput([ScheduledRequest(Req(list(range(10, 16)), [7, 6], 5), 1)] + forks)


def decode_step() -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(Req(list(range(10, 10 + n)), [7, 8, 9], n - 1), 1)
                            for n in (6, 3, 9)])


STEPS = {"mixed": mixed_step, "five": five_token_step, "classification": classification_step,
         "decode": decode_step}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    """A tiny Llama, or a tiny Gemma 3 (a sliding layer with a window of 4, shorter than the steps'
    prompts, then a global one: two RoPE tables, pre/post feed-forward norms, the embedding scale)."""
    from transformers import Gemma3TextConfig, LlamaConfig

    from weir.engine.models.gemma3 import Gemma3ForCausalLM
    from weir.engine.models.llama import LlamaForCausalLM

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if request.param == "llama":
        m = LlamaForCausalLM(LlamaConfig(**sizes), torch.float32, 64)
    else:
        cfg = Gemma3TextConfig(**sizes, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                               layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
        m = Gemma3ForCausalLM(cfg, torch.float32, 64)
    m.init_dummy(0)
    return m.eval()


def random_cache(model, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32):
    """Every slot holds random data, so a write anywhere shows."""
    cfg = model.config
    shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, NUM_BLOCKS, block_size, 16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)


def layer_caches(cache):
    return [(cache[i, 0], cache[i, 1]) for i in range(cache.shape[0])]


def eager(model, backend, sched, cache, pad_to=None, block_size=BLOCK_SIZE, device=CPU):
    """The model's own forward; with ``pad_to``, over the step plus one fresh request of padding
    tokens (slot -1) packed last, so that every row-wise op sees ``pad_to`` rows as the bucket does."""
    t = sched.num_tokens
    if pad_to is not None and pad_to > t:
        pad = Req([0] * (pad_to - t), [0] * -(-(pad_to - t) // block_size), 0)
        sched = SchedulerOutput(sched.scheduled + [ScheduledRequest(pad, pad_to - t)])
    inputs = build_step_inputs(sched, block_size, device, backend.index_dtype)
    slots = inputs.slot_mapping.clone()
    slots[t:] = -1
    inputs = replace(inputs, slot_mapping=slots, num_actual_tokens=t)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, layer_caches(cache), backend,
                       backend.build_metadata(inputs))
    return hidden[:t]


def piecewise(model, backend, sched, cache, sizes, block_size=BLOCK_SIZE, device=CPU, graphs=None):
    """The step through piecewise graphs whose buffers hold what a larger earlier step left there."""
    if graphs is None:
        graphs = PiecewiseGraphs(model, backend, layer_caches(cache), sizes, device, capture=False)
    for buf in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.attn_out):
        buf.fill_(3)
    inputs = build_step_inputs(sched, block_size, device, backend.index_dtype)
    with torch.inference_mode():
        return graphs.run(inputs).clone(), graphs


@pytest.mark.parametrize("step", ["mixed", "five", "classification", "decode"])
def test_bucket_of_the_step_size_equals_the_eager_forward_exactly(model, step):
    backend = TorchAttentionBackend()
    sched = STEPS[step]()
    t = sched.num_tokens
    before = random_cache(model)
    want_cache, got_cache = before.clone(), before.clone()
    want = eager(model, backend, sched, want_cache)
    got, _ = piecewise(model, backend, sched, got_cache, [1, 2, t, 64])
    assert got.shape == (t, 64)
    assert torch.equal(got, want)
    assert torch.equal(got_cache, want_cache)
    assert not torch.equal(got_cache, before)


@pytest.mark.parametrize("step, bucket", [("five", 8), ("mixed", 16), ("classification", 16), ("decode", 4)])
def test_padded_bucket_equals_the_eager_forward_of_as_many_rows(model, step, bucket):
    """The real rows equal the eager forward over the same number of rows exactly (the CPU matmul
    rounds differently for some row counts, so the unpadded forward agrees to rounding only), and
    the cache is written exactly as that forward writes it."""
    backend = TorchAttentionBackend()
    sched = STEPS[step]()
    before = random_cache(model)
    want_cache, got_cache, unpadded_cache = before.clone(), before.clone(), before.clone()
    want = eager(model, backend, sched, want_cache, pad_to=bucket)
    got, graphs = piecewise(model, backend, sched, got_cache, [1, 2, 4, 8, 16])
    assert graphs.padded_size(sched.num_tokens) == bucket
    assert torch.equal(got, want)
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got, eager(model, backend, sched, unpadded_cache), atol=1e-5, rtol=1e-5)
    # the padding rows the next piece read: token 0, position 0, zero attention output
    t = sched.num_tokens
    assert graphs.input_ids[t:bucket].tolist() == [0] * (bucket - t)
    assert graphs.positions[t:bucket].tolist() == [0] * (bucket - t)
    assert graphs.slot_mapping[t:bucket].tolist() == [-1] * (bucket - t)
    assert not graphs.attn_out[t:bucket].any()


def changed_slots(after, before):
    """Slot ids where any layer's key or value differs. Cache: [layers, 2, kv_heads, blocks, block_size, head_dim]."""
    return (after != before).any(-1).any(2).any(1).any(0).flatten().nonzero().flatten().tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter")
def test_padding_rows_write_nothing_to_the_cache_on_the_triton_backend(model):
    """The Triton backend writes every row it is given and skips slot -1: the slots that change
    are exactly the step's five, never slot 0 (token 0 at position 0 of each padding row). The
    Triton kernels take blocks of 8 tokens or more."""
    from weir.engine.attention import TritonAttentionBackend

    backend = TritonAttentionBackend()
    model.use_kernels(backend.model_kernels)
    try:
        sched = five_token_step()
        before = random_cache(model, block_size=8)
        after = before.clone()
        got, graphs = piecewise(model, backend, sched, after, [8], block_size=8)
        changed = changed_slots(after, before)
        step_slots = build_step_inputs(sched, 8, CPU, torch.int32).slot_mapping.tolist()
        assert step_slots == [61, 50, 51, 24, 25]
        assert changed == sorted(step_slots)
        want = eager(model, backend, sched, before.clone(), pad_to=8, block_size=8)
        assert torch.equal(got, want)
    finally:
        model.use_kernels(False)


def test_dispatch_full_for_decodes_piecewise_for_the_rest_that_fits_eager_above(model):
    backend = TorchAttentionBackend()
    caches = layer_caches(random_cache(model))
    full, pw, summary = build_cuda_graphs(model, backend, caches, CUDAGraphMode.FULL_AND_PIECEWISE, 2, 4,
                                          BLOCK_SIZE, [1, 2, 4, 8, 16], CPU, capture=False)
    assert (full.sizes, pw.sizes) == ([1, 2], [1, 2, 4, 8, 16])
    assert summary == ("FULL_AND_PIECEWISE: 2 full (batch sizes 1..2) + 5x3 piecewise (token counts 1..16) "
                       "CUDA graphs")
    two_decodes = SchedulerOutput(decode_step().scheduled[:2])
    big = SchedulerOutput([ScheduledRequest(Req(list(range(17)), [0] * 5, 0), 17)])
    cases = [two_decodes, decode_step(), mixed_step(), classification_step(), big, SchedulerOutput()]
    assert [dispatch(s, full, pw) for s in cases] == [FULL, PIECEWISE, PIECEWISE, PIECEWISE, EAGER, EAGER]
    assert [dispatch(s, None, pw) for s in cases] == [PIECEWISE] * 4 + [EAGER] * 2
    assert [dispatch(s, full, None) for s in cases] == [FULL] + [EAGER] * 5
    full, pw, _ = build_cuda_graphs(model, backend, caches, CUDAGraphMode.PIECEWISE, 2, 4, BLOCK_SIZE, [4], CPU,
                                    capture=False)
    assert full is None and pw.sizes == [4]
    with pytest.raises(ValueError, match="no piecewise CUDA graph for a step of 10 tokens"):
        pw.run(build_step_inputs(mixed_step(), BLOCK_SIZE, CPU, backend.index_dtype))


def test_capture_sizes_and_mode_knobs():
    assert piecewise_capture_sizes(512) == [1, 2, 4, 8, *range(16, 257, 16), 320, 384, 448, 512]
    assert piecewise_capture_sizes(13) == [1, 2, 4, 8, 13]
    assert piecewise_capture_sizes(1) == [1]
    assert resolve_capture_sizes(None, None, 8192) == piecewise_capture_sizes(2048)
    assert resolve_capture_sizes(None, None, 2048) == piecewise_capture_sizes(2048)
    assert resolve_capture_sizes(None, None, 100) == piecewise_capture_sizes(100)
    assert resolve_capture_sizes([64, 8, 2, 8], 32, 2048) == [2, 8]
    with pytest.raises(ValueError, match="no cudagraph_capture_sizes"):
        resolve_capture_sizes([64], 32, 2048)
    assert EngineArgs(cudagraph_mode="piecewise").cudagraph_mode == "PIECEWISE"
    with pytest.raises(ValueError, match="cudagraph_mode='FULL' is not one of"):
        EngineArgs(cudagraph_mode="FULL")
    for bad in ([0, 4], [], "8", [2.0], [True]):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            EngineArgs(cudagraph_capture_sizes=bad)
    assert EngineArgs(cudagraph_capture_sizes=[8, 4, 8]).cudagraph_capture_sizes == [4, 8]
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineArgs(max_cudagraph_capture_size="512")
    with pytest.raises(ValueError, match="measure_step_gpu_time"):
        EngineArgs(measure_step_gpu_time="yes")
    with pytest.raises(ValueError, match="capture sizes must be ascending"):
        PiecewiseGraphs(None, None, None, [4, 2], CPU, capture=False)


class OpCounter:
    """Counts the aten ops that allocate or compute (views left out), by where they ran: inside a
    piece, inside a layer's attention call, or neither."""

    def __init__(self):
        from collections import Counter

        self.where = "outside"
        self.counts = {"piece": Counter(), "attention": Counter(), "outside": Counter()}

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not func.is_view:
                    counter.counts[counter.where][func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        return Mode()

    def wrap(self, where, fn):
        def wrapped(*args, **kwargs):
            outer, self.where = self.where, where
            try:
                return fn(*args, **kwargs)
            finally:
                self.where = outer
        return wrapped


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter")
def test_only_attention_runs_between_the_pieces(model, monkeypatch):
    """On the Triton backend (its metadata is views: no op), what runs outside the pieces is the
    step's input copies and padding fills, one copy of attention's output per layer, and the
    attention calls, which launch their kernels and allocate their output: no matmul, norm,
    rotary or activation of the model runs outside a piece."""
    from weir.engine.attention import TritonAttentionBackend
    from weir.engine.models.llama import LlamaDecoderLayer

    backend = TritonAttentionBackend()
    model.use_kernels(backend.model_kernels)
    counter = OpCounter()
    monkeypatch.setattr(PiecewiseGraphs, "_piece", counter.wrap("piece", PiecewiseGraphs._piece))
    monkeypatch.setattr(LlamaDecoderLayer, "attention", counter.wrap("attention", LlamaDecoderLayer.attention))
    try:
        cache = random_cache(model, block_size=8)
        graphs = PiecewiseGraphs(model, backend, layer_caches(cache), [8], CPU, capture=False)
        inputs = build_step_inputs(five_token_step(), 8, CPU, backend.index_dtype)
        with torch.inference_mode(), counter.mode():
            graphs.run(inputs)
    finally:
        model.use_kernels(False)
    num_layers = len(model.layers)
    # input_ids, positions, slot_mapping in, then attention's output once per layer
    assert dict(counter.counts["outside"]) == {"copy_": 3 + num_layers, "zero_": 3, "fill_": 1}
    # the attention calls: their output, and the interpreter moving the kernels' tensors about
    assert counter.counts["attention"]["empty_like"] == num_layers
    assert set(counter.counts["attention"]) <= {"empty_like", "empty", "new_empty", "copy_", "set_"}
    # and the pieces hold the model's math: 4 projections per layer and the embedding (rotary and
    # SwiGLU are Triton kernels on this backend: no aten silu anywhere)
    piece = counter.counts["piece"]
    assert (piece["linear"], piece["embedding"], piece["silu"]) == (4 * num_layers, 1, 0)


def test_gpu_time_read_from_events_once_they_complete(monkeypatch):
    """With measure_gpu_time each step records two CUDA events; a step's GPU time is added when
    its end event has completed, and stats wait for the ones still pending (fake events: CPU)."""
    from weir.engine.cudagraph_stats import CUDAGraphStats

    class FakeEvent:
        made = []

        def __init__(self, enable_timing):
            self.done, self.waited, self.t_ms = False, False, 0.0
            FakeEvent.made.append(self)

        def record(self):
            self.t_ms = 250.0 * len(FakeEvent.made)

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

        def elapsed_time(self, end):
            return end.t_ms - self.t_ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    stats = CUDAGraphStats(measure_gpu_time=True)
    stats.record(PIECEWISE, 6, 2, stats.start())  # events 1, 2: 250 ms apart, not done
    assert stats.gpu_time_s[PIECEWISE] == 0.0
    FakeEvent.made[1].done = True
    stats.record(FULL, 2, 0, stats.start())  # events 3, 4: the piecewise step is read now
    assert (stats.gpu_time_s[PIECEWISE], stats.gpu_time_s[FULL]) == (0.25, 0.0)
    out = stats.as_dict()
    assert FakeEvent.made[3].waited and not FakeEvent.made[1].waited
    assert (out["forward_gpu_time_s_cudagraph_piecewise"], out["forward_gpu_time_s_cudagraph_full"],
            out["forward_gpu_time_s_eager"]) == (0.25, 0.25, 0.0)
    assert (out["num_steps_cudagraph_piecewise"], out["num_tokens_cudagraph_piecewise"],
            out["num_padding_tokens_cudagraph_piecewise"], out["num_steps_eager"]) == (1, 6, 2, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_piecewise_graphs_on_cuda():
    """The real capture (bf16, Triton backend): two buckets replayed one after the other through the
    same buffers, each step's hidden states as the eager forward's over as many rows, and the
    cache changed at the step's slots only."""
    from transformers import LlamaConfig

    from weir.engine.attention import TritonAttentionBackend
    from weir.engine.models.llama import LlamaForCausalLM

    dev = torch.device("cuda")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg, torch.bfloat16, 64)
    m.init_dummy(0)
    m = m.to(dev).eval()
    backend = TritonAttentionBackend()
    m.use_kernels(backend.model_kernels)
    before = random_cache(m, block_size=8, device=dev, dtype=torch.bfloat16)
    after = before.clone()
    graphs = PiecewiseGraphs(m, backend, layer_caches(after), [8, 16], dev)
    for sched, bucket in ((mixed_step(), 16), (five_token_step(), 8)):
        start = after.clone()
        got, _ = piecewise(m, backend, sched, after, None, block_size=8, device=dev, graphs=graphs)
        want_cache = start.clone()
        want = eager(m, backend, sched, want_cache, pad_to=bucket, block_size=8, device=dev)
        torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
        step_slots = build_step_inputs(sched, 8, dev, torch.int32).slot_mapping.tolist()
        assert changed_slots(after, start) == sorted(step_slots)
        torch.testing.assert_close(after.float(), want_cache.float(), atol=1.6e-2, rtol=1.6e-2)


def test_capture_runs_with_the_collector_frozen_and_unfreezes_after(monkeypatch):
    """build_cuda_graphs captures both sets with every earlier object in the permanent generation
    (torch.cuda.graph collects as each capture begins), and leaves nothing frozen, also when a
    capture raises (the CUDA calls and graph classes are stand-ins: CPU)."""
    import gc

    from weir.engine import cuda_graphs, piecewise_graphs

    seen = []

    class Recorder:
        sizes, num_pieces = [1, 2], 3

        def __init__(self, *args, **kwargs):
            seen.append(gc.get_freeze_count())
            if kwargs.get("fail"):
                raise RuntimeError("capture failed")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 31))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda_graphs, "DecodeGraphs", Recorder)
    monkeypatch.setattr(piecewise_graphs, "PiecewiseGraphs", Recorder)
    assert gc.get_freeze_count() == 0
    full, piecewise, _ = build_cuda_graphs(None, None, [], CUDAGraphMode.FULL_AND_PIECEWISE, 4, 8, 16, [1, 2],
                                           torch.device("cuda"))
    assert isinstance(full, Recorder) and isinstance(piecewise, Recorder)
    assert len(seen) == 2 and min(seen) > 0, seen
    assert gc.get_freeze_count() == 0

    with pytest.raises(RuntimeError):
        with cuda_graphs.frozen_gc():
            assert gc.get_freeze_count() > 0
            Recorder(fail=True)
    assert gc.get_freeze_count() == 0
