"""Piecewise CUDA graphs: the model forward cut at every attention call, as vLLM V1 captures it.

A step with a prefill chunk cannot replay a whole-forward graph, because attention depends on each
request's query and context lengths. Everything else in the forward is row-wise (embedding, norms,
projections, rotary, MLP) and depends only on the number of tokens. So the forward is cut into
``num_layers + 1`` pieces at the attention calls:

- piece 0: embedding, rotary tables, layer 0's input norm, q/k/v projection, rotary;
- piece i (``1 <= i < num_layers``): layer i-1's o_proj, post-attention norm (after the residual
  add) and MLP, then layer i's input norm, q/k/v projection and rotary;
- piece ``num_layers``: the last layer's o_proj, post-attention norm and MLP, the final norm.

Each piece is captured once per bucket, a padded token count; attention (KV write + kernel) runs
eagerly between the replays on the step's own metadata. A step of ``T`` tokens replays the
smallest bucket ``B >= T``: rows ``T..B`` are padding (token 0, position 0, slot -1), computed but
never written to the cache and dropped at the end; attention writes its output for the ``T`` real
rows into the buffer the next piece reads, whose padding rows are zero.

One set of static buffers, sized for the largest bucket, serves every bucket (bucket ``B`` reads
and writes their first ``B`` rows). Each piece copies its outputs into them, so no graph output
stays alive in the shared memory pool between replays.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from weir.engine.step_inputs import StepInputs


DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 2048
"""The largest piecewise bucket unless ``max_cudagraph_capture_size`` says otherwise (tokens). On
W-mixed at 256 sequences a cap of 512 leaves 121 of 442 steps (176K of 218K tokens) of the 135M
shape eager, 2048 leaves 9 (``bench.step_mix``), for about 25 more buckets to capture: BENCHMARKS.md,
"GPU plan", the piecewise cap."""


def piecewise_capture_sizes(max_capture_size: int) -> list[int]:
    """Default buckets: 1, 2, 4, 8, then every multiple of 16 below 256, then every multiple of 64,
    up to ``max_capture_size`` (always included), ascending. Padding stays under 16 tokens below
    256 and under 64 above (vLLM pads in steps of 8 and 16; coarser steps capture fewer graphs)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_capture_size]
    sizes += list(range(16, min(max_capture_size, 256), 16))
    sizes += list(range(256, max_capture_size, 64))
    return sizes + [max_capture_size]


def resolve_capture_sizes(cudagraph_capture_sizes: list[int] | None, max_cudagraph_capture_size: int | None,
                          max_num_batched_tokens: int) -> list[int]:
    """The piecewise buckets of an engine, as vLLM reads its two knobs: the given sizes (sorted,
    repeats dropped) up to ``max_cudagraph_capture_size``, or :func:`piecewise_capture_sizes` of
    ``max_cudagraph_capture_size`` (default :data:`DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE`); never above ``max_num_batched_tokens``, the most
    tokens a step can hold.

    Raises:
        ValueError: a size below 1, or no size left.
    """
    limit = min(max_cudagraph_capture_size or DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE, max_num_batched_tokens)
    if cudagraph_capture_sizes is None:
        return piecewise_capture_sizes(limit)
    if any(b < 1 for b in cudagraph_capture_sizes):
        raise ValueError(f"cudagraph_capture_sizes must be >= 1, got {cudagraph_capture_sizes}")
    sizes = sorted({b for b in cudagraph_capture_sizes if b <= limit})
    if not sizes:
        raise ValueError(f"no cudagraph_capture_sizes {cudagraph_capture_sizes} is <= {limit} "
                         "(max_cudagraph_capture_size, max_num_batched_tokens)")
    return sizes


class PiecewiseGraphs:
    """Owns the piece graphs of every bucket and the static buffers they read and write.

    Args:
        model: the ``LlamaForCausalLM``.
        attn_backend: the backend attention runs on between the pieces (its ``index_dtype`` sets
            the integer buffers' dtype).
        kv_caches: the per-layer ``(key_cache, value_cache)`` pairs attention reads and writes.
        capture_sizes: the buckets (token counts), ascending, distinct, >= 1.
        device: where the model lives.
        pool: the graph memory pool shared with the other graphs (``torch.cuda.graph_pool_handle()``);
            None: a new one.
        capture: False keeps the buffers, padding and piece boundaries but runs every piece eagerly
            (what the CPU tests check them with).

    Raises:
        ValueError: ``capture_sizes`` empty, unsorted, repeated or below 1.
    """

    def __init__(self, model, attn_backend, kv_caches, capture_sizes: list[int], device: torch.device,
                 pool=None, capture: bool = True):
        if not capture_sizes or sorted(set(capture_sizes)) != list(capture_sizes) or capture_sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending, distinct and >= 1, got {capture_sizes}")
        self.sizes = list(capture_sizes)
        self._model, self._backend, self._kv_caches = model, attn_backend, kv_caches
        self.num_pieces = len(model.layers) + 1
        layer = model.layers[0]
        n, hidden, hd = self.sizes[-1], model.config.hidden_size, layer.head_dim
        dtype = model.embed_tokens.weight.dtype
        idx = attn_backend.index_dtype

        def buf(*shape, dtype=dtype):
            return torch.zeros(n, *shape, dtype=dtype, device=device)

        self.input_ids, self.positions = buf(dtype=idx), buf(dtype=idx)
        self.slot_mapping = torch.full((n,), -1, dtype=idx, device=device)
        # cos/sin: [*tables, tokens, 1, head_dim], the rows embed() gathers from each RoPE table
        # (*tables: the leading dims of model.cos_cache before [max_positions, head_dim]; none for one table);
        # q, attn_out: [tokens, num_heads, head_dim]; k, v: [tokens, num_kv_heads, head_dim]
        tables = tuple(model.cos_cache.shape[:-2])
        self.cos, self.sin = (torch.zeros(*tables, n, 1, hd, dtype=dtype, device=device) for _ in range(2))
        self.q, self.attn_out = buf(layer.num_heads, hd), buf(layer.num_heads, hd)
        self.k, self.v = buf(layer.num_kv_heads, hd), buf(layer.num_kv_heads, hd)
        self.residual, self.hidden = buf(hidden), buf(hidden)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if capture:
            self._capture(device, pool if pool is not None else torch.cuda.graph_pool_handle())

    def _capture(self, device: torch.device, pool) -> None:
        with torch.inference_mode():
            for b in reversed(self.sizes):
                # warm-up outside the capture (Triton compiles, cuBLAS picks its kernels), on a
                # side stream as torch.cuda.graph asks
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for i in range(self.num_pieces):
                        self._piece(i, b)
                torch.cuda.current_stream(device).wait_stream(side)
                graphs = []
                for i in range(self.num_pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._piece(i, b)
                    graphs.append(graph)
                self._graphs[b] = graphs

    def _piece(self, i: int, b: int) -> None:
        """Piece ``i`` over the first ``b`` rows: reads the static inputs (piece 0) or the attention
        output and residual, writes q/k/v/residual (or, last piece, the final hidden states)."""
        m = self._model
        if i == 0:
            x, cos, sin = m.embed(self.input_ids[:b], self.positions[:b])
            if not m.kernels_enabled:  # per-token rows, read by every layer's piece
                self.cos[..., :b, :, :].copy_(cos)
                self.sin[..., :b, :, :].copy_(sin)
            residual = None
        else:
            x, residual = m.layers[i - 1].post_attention(self.attn_out[:b], self.residual[:b])
        if i == self.num_pieces - 1:
            self.hidden[:b].copy_(m.norm(x, residual)[0])
            return
        # the rotary kernel reads the whole tables at the (static) positions itself
        cos, sin = (m.cos_cache, m.sin_cache) if m.kernels_enabled else (self.cos[..., :b, :, :], self.sin[..., :b, :, :])
        q, k, v, residual = m.layers[i].pre_attention(x, residual, self.positions[:b], cos, sin)
        self.q[:b].copy_(q)
        self.k[:b].copy_(k)
        self.v[:b].copy_(v)
        self.residual[:b].copy_(residual)

    def padded_size(self, num_tokens: int) -> int | None:
        """The bucket a step of ``num_tokens`` tokens replays, or None if it is above the largest."""
        for b in self.sizes:
            if b >= num_tokens:
                return b
        return None

    def run(self, step: StepInputs) -> torch.Tensor:
        """Run one step: pieces replayed (or run eagerly without capture), attention eager between.

        Args:
            step: any step (decodes, chunks over a prefix, fresh prompts) whose ``num_tokens`` fits
                a bucket, built for this object's attention backend.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states, a view of the static output buffer
            that the next run overwrites.

        Raises:
            ValueError: the step has more tokens than the largest bucket, or none.
        """
        t = step.num_tokens
        b = self.padded_size(t)
        if b is None or t == 0:
            raise ValueError(f"no piecewise CUDA graph for a step of {t} tokens (buckets {self.sizes})")
        self.input_ids[:t].copy_(step.input_ids)
        self.input_ids[t:b].zero_()
        self.positions[:t].copy_(step.positions)
        self.positions[t:b].zero_()
        self.slot_mapping[:t].copy_(step.slot_mapping)
        self.slot_mapping[t:b].fill_(-1)
        self.attn_out[t:b].zero_()
        backend = self._backend
        meta = backend.build_metadata(replace(step, slot_mapping=self.slot_mapping[:b]))
        graphs = self._graphs.get(b)
        for i in range(self.num_pieces):
            if graphs is None:  # built with capture=False: the same buffers, run eagerly
                self._piece(i, b)
            else:
                graphs[i].replay()
            if i < self.num_pieces - 1:
                key_cache, value_cache = self._kv_caches[i]
                o = self._model.layers[i].attention(self.q[:b], self.k[:b], self.v[:b], key_cache, value_cache,
                                                    backend, meta)
                self.attn_out[:t].copy_(o[:t])
        return self.hidden[:t]
