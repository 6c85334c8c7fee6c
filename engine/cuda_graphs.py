"""CUDA graphs of the decode step (full graphs), the graph modes, and which mode a step runs in.

A decode step of a small model is a few hundred short kernels; launching them from Python costs
more than running them. Each graph records the whole forward pass (embedding to final norm) for one
batch size; a step with ``n`` decodes replays the graph of the smallest captured size >= ``n`` with
the extra rows padded (slot -1: nothing written; context length 0: zero output). Prefill steps run
through piecewise graphs (:mod:`weir.engine.piecewise_graphs`) when they fit a bucket, else
eagerly. Only the model forward is captured; logits and sampling run after it.

All graphs share one memory pool and one set of static inputs: a :class:`StepInputs` of the
largest batch, made by the step builder itself (the same packed layout as every step), whose
first ``b`` rows the graph of size ``b`` reads. The largest graph is captured first, so the
smaller ones fit inside its pool.

The modes are vLLM's ``cudagraph_mode`` values (:class:`CUDAGraphMode`); a step's runtime mode is
one of :data:`RUNTIME_MODES` (:func:`dispatch`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from weir.engine.engine_args import CUDAGraphMode
from weir.engine.scheduler import SchedulerOutput
from weir.engine.step_inputs import StepInputs, build_step_inputs

logger = logging.getLogger(__name__)


FULL, PIECEWISE, EAGER = "full", "piecewise", "eager"
RUNTIME_MODES = (FULL, PIECEWISE, EAGER)
"""How one step's forward runs: a full decode graph, piecewise graphs, or eagerly."""


def dispatch(sched: SchedulerOutput, full: DecodeGraphs | None, piecewise) -> str:
    """The runtime mode of a step: ``full`` for a decode-only step within the full graphs' batch
    sizes, else ``piecewise`` when its token count fits a piecewise bucket, else ``eager``.

    Args:
        sched: the step.
        full: the full decode graphs, or None.
        piecewise: the ``PiecewiseGraphs``, or None.
    """
    num_reqs, num_tokens = len(sched.scheduled), sched.num_tokens
    if full is not None and num_reqs and num_tokens == num_reqs and full.padded_size(num_reqs) is not None:
        return FULL
    if piecewise is not None and num_tokens and piecewise.padded_size(num_tokens) is not None:
        return PIECEWISE
    return EAGER


@contextlib.contextmanager
def frozen_gc():
    """Collect once, then move every tracked object to the permanent generation for the block.

    ``torch.cuda.graph`` runs ``gc.collect()`` as each capture begins; with the model and the
    engine's objects frozen, each of those collections walks only what the capture itself made, so
    capturing hundreds of graphs does not walk the whole heap hundreds of times (vLLM freezes the
    collector around its capture for the same reason). Objects created inside stay collectable;
    the frozen ones are unfrozen on exit, whether the block raised or not.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (which
    is always included), ascending."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Owns the captured decode graphs, their memory pool and static inputs/outputs.

    Args:
        model: the ``LlamaForCausalLM`` (on CUDA, fp16/bf16).
        attn_backend: the Triton backend (its metadata is views of the static inputs).
        kv_caches: the per-layer ``(key_cache, value_cache)`` pairs the graphs read and write.
        max_num_seqs: the largest decode batch.
        max_num_blocks: block-table width, ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        device: the CUDA device.
        capture: False keeps the static inputs and padding but runs every replay eagerly (what
            the CPU tests check the padding and input copies with).
        pool: the graph memory pool shared with the piecewise graphs; None: a new one.
    """

    def __init__(self, model, attn_backend, kv_caches, max_num_seqs: int, max_num_blocks: int,
                 block_size: int, device: torch.device, capture: bool = True, pool=None):
        t0 = time.perf_counter()
        self.sizes = decode_batch_sizes(max_num_seqs)
        # all rows padding: token 0, position 0, slot -1, seq_lens 0
        self.static_inputs = build_step_inputs(
            SchedulerOutput(), block_size, device, attn_backend.index_dtype,
            num_padded_decodes=self.sizes[-1], block_table_width=max_num_blocks)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._model, self._backend, self._kv_caches = model, attn_backend, kv_caches
        if not capture:
            return
        if pool is None:
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
        """The model forward over the first ``b`` rows of the static inputs."""
        inputs = self.static_inputs.decode_rows(b)
        return self._model(inputs.input_ids, inputs.positions, self._kv_caches, self._backend,
                           self._backend.build_metadata(inputs))

    def padded_size(self, num_decodes: int) -> int | None:
        """The captured batch size a step of ``num_decodes`` decodes replays, or None if too many."""
        for b in self.sizes:
            if b >= num_decodes:
                return b
        return None

    def copy_inputs(self, step: StepInputs) -> int:
        """Copy a padded decode-only step into the static inputs; returns its batch size.

        Raises:
            ValueError: no graph has that batch size, or the step's block table is wider than
                the static one.
        """
        b, width = step.block_table.shape
        static = self.static_inputs
        if b not in self.sizes or step.num_decodes != b or width > static.block_table.shape[1]:
            raise ValueError(f"no decode graph for {step.num_decodes} decodes in {b} rows "
                             f"with {width} blocks per request")
        static.input_ids[:b].copy_(step.input_ids)
        static.positions[:b].copy_(step.positions)
        static.slot_mapping[:b].copy_(step.slot_mapping)
        static.seq_lens[:b].copy_(step.seq_lens)
        # columns past width keep stale ids: they are never read, because a request reads only
        # the blocks of its context (query_start_loc is 0..b for every decode batch: no copy)
        static.block_table[:b, :width].copy_(step.block_table)
        return b

    def replay(self, step: StepInputs) -> torch.Tensor:
        """Copy a padded decode-only step into the static inputs and replay its graph.

        Args:
            step: built with ``num_padded_decodes`` equal to a captured size.

        Returns:
            ``[padded_size, hidden_size]`` final hidden states, a view of the graph's output that
            the next replay overwrites.

        Raises:
            ValueError: see :meth:`copy_inputs`.
        """
        b = self.copy_inputs(step)
        if b not in self._graphs:  # built with capture=False: the same buffers, run eagerly
            return self._forward(b)
        self._graphs[b].replay()
        return self._hidden[b]


def build_cuda_graphs(model, attn_backend, kv_caches, mode: CUDAGraphMode, max_num_seqs: int,
                      max_num_blocks: int, block_size: int, capture_sizes: list[int], device: torch.device,
                      capture: bool = True):
    """The full decode graphs and the piecewise graphs that ``mode`` asks for, in one memory pool,
    captured with the garbage collector's objects frozen (:func:`frozen_gc`).

    The set whose largest size is larger is captured first (each set captures from its largest
    size down), so the pool takes its size from the largest capture and every later one reuses it.

    Args:
        mode: which graphs to build.
        max_num_seqs, max_num_blocks, block_size: size the full decode graphs (:class:`DecodeGraphs`).
        capture_sizes: the piecewise buckets (``weir.engine.piecewise_graphs``).
        capture: False builds the buffers and runs every replay eagerly (CPU tests).

    Returns:
        ``(full, piecewise, summary)``: a :class:`DecodeGraphs` or None, a ``PiecewiseGraphs`` or
        None, and one line saying what was captured, in how many seconds and how much device
        memory it took (free memory before minus after: pool, static buffers, workspaces).
    """
    from weir.engine.piecewise_graphs import PiecewiseGraphs

    t0 = time.perf_counter()
    free_before = torch.cuda.mem_get_info(device)[0] if capture else 0
    pool = torch.cuda.graph_pool_handle() if capture else None
    full = piecewise = None

    def build_full():
        return DecodeGraphs(model, attn_backend, kv_caches, max_num_seqs, max_num_blocks, block_size, device,
                            capture=capture, pool=pool)

    def build_piecewise():
        return PiecewiseGraphs(model, attn_backend, kv_caches, capture_sizes, device, pool=pool, capture=capture)

    with frozen_gc() if capture else contextlib.nullcontext():
        if mode.has_full and mode.has_piecewise and capture_sizes[-1] > max_num_seqs:
            piecewise, full = build_piecewise(), build_full()
        else:
            full = build_full() if mode.has_full else None
            piecewise = build_piecewise() if mode.has_piecewise else None
    parts = []
    if full is not None:
        parts.append(f"{len(full.sizes)} full (batch sizes {full.sizes[0]}..{full.sizes[-1]})")
    if piecewise is not None:
        parts.append(f"{len(piecewise.sizes)}x{piecewise.num_pieces} piecewise "
                     f"(token counts {piecewise.sizes[0]}..{piecewise.sizes[-1]})")
    summary = f"{mode.value}: {' + '.join(parts) or 'none'} CUDA graphs"
    if capture:
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        summary += f" captured in {time.perf_counter() - t0:.1f} s, {used / (1 << 20):.0f} MiB"
    logger.info("%s", summary)
    return full, piecewise, summary
