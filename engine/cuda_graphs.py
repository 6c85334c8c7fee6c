"""CUDA graphs of the decode step: captured once at start-up, replayed for every decode-only step.

A decode step of a small model is a few hundred short kernels; launching them from Python costs
more than running them. Each graph records the whole forward pass (embedding to final norm) for one
batch size; a step with ``n`` decodes replays the graph of the smallest captured size >= ``n`` with
the extra rows padded (slot -1: nothing written; context length 0: zero output). Prefill steps run
eagerly. Only the model forward is captured; logits and sampling run after it.

All graphs share one memory pool and one set of static input buffers sized for the largest batch
(captured first, so the smaller graphs fit inside its pool).
"""

from __future__ import annotations

import logging
import time

import torch

from weir.engine.attention import AttentionMetadata
from weir.engine.step_inputs import KernelStep

logger = logging.getLogger(__name__)


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (which
    is always included), ascending."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Owns the captured decode graphs, their memory pool and static input/output buffers.

    Args:
        model: the ``LlamaForCausalLM`` (on CUDA, fp16/bf16).
        kv_caches: the per-layer ``(key_cache, value_cache)`` pairs the graphs read and write.
        max_num_seqs: the largest decode batch.
        max_num_blocks: block-table width, ``ceil(max_model_len / block_size)``.
        device: the CUDA device.
        capture: False keeps the static buffers and padding but runs every replay eagerly (what
            the CPU tests check the padding with).
    """

    def __init__(self, model, kv_caches, max_num_seqs: int, max_num_blocks: int, device: torch.device,
                 capture: bool = True):
        t0 = time.perf_counter()
        self.sizes = decode_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self._input_ids = torch.zeros(n, **i32)
        self._positions = torch.zeros(n, **i32)
        self._slot_mapping = torch.full((n,), -1, **i32)
        self._context_lens = torch.zeros(n, **i32)
        self._block_tables = torch.zeros(n, max_num_blocks, **i32)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._model, self._kv_caches = model, kv_caches
        if not capture:
            return
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.sizes):
                # warm-up outside the capture (Triton compiles, cuBLAS picks its kernels), on a
                # side stream as torch.cuda.graph asks
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._forward(b)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._hidden[b] = self._forward(b)
                self._graphs[b] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.sizes), self.sizes, time.perf_counter() - t0)

    def _forward(self, b: int) -> torch.Tensor:
        """The model forward over the first ``b`` rows of the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping[:b], num_decode_tokens=b, use_kernels=True,
            decode_block_tables=self._block_tables[:b], decode_context_lens=self._context_lens[:b],
        )
        return self._model(self._input_ids[:b], self._positions[:b], self._kv_caches, meta)

    def padded_size(self, num_decodes: int) -> int | None:
        """The captured batch size a step of ``num_decodes`` decodes replays, or None if too many."""
        for b in self.sizes:
            if b >= num_decodes:
                return b
        return None

    def replay(self, step: KernelStep) -> torch.Tensor:
        """Copy a padded decode-only step into the static buffers and replay its graph.

        Args:
            step: built with ``num_padded_decodes`` equal to a captured size.

        Returns:
            ``[padded_size, hidden_size]`` final hidden states, a view of the graph's output that
            the next replay overwrites.
        """
        b = step.input_ids.shape[0]
        nd, width = step.meta.decode_block_tables.shape
        if b not in self.sizes or width > self._block_tables.shape[1]:
            raise ValueError(f"no decode graph for batch {b} with {width} blocks per request")
        self._input_ids[:b].copy_(step.input_ids)
        self._positions[:b].copy_(step.positions)
        self._slot_mapping[:b].copy_(step.meta.slot_mapping)
        self._context_lens[:b].copy_(step.meta.decode_context_lens)
        # rows past nd and columns past width keep stale ids: they are never read, because a
        # request reads only the blocks of its context and padding rows have context 0
        self._block_tables[:nd, :width].copy_(step.meta.decode_block_tables)
        if b not in self._graphs:  # built with capture=False: the same buffers, run eagerly
            return self._forward(b)
        self._graphs[b].replay()
        return self._hidden[b]
