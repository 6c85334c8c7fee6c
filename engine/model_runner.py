"""Runs one scheduled step on the model: builds its inputs, owns the KV cache, samples."""

from __future__ import annotations

import torch

from weir.engine.attention import AttentionBackend, TorchAttentionBackend, select_attention_backend
from weir.engine.cuda_graphs import FULL, PIECEWISE, CUDAGraphMode, build_cuda_graphs, dispatch
from weir.engine.cudagraph_stats import CUDAGraphStats
from weir.engine.host_transfer import HostTransfer, to_device
from weir.engine.input_batch import InputBatch
from weir.engine.logprobs import gather_logprobs, logprob_entries
from weir.engine.sampler import SampleRow, sample_tokens
from weir.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from weir.engine.step_inputs import build_step_inputs
from weir.engine.structured_outputs import apply_grammar_bitmask


class ModelRunner:
    """Owns the model's attention backend, the KV cache tensors, the persistent batch (each
    scheduled request's block-table row, kept across steps) and the CUDA graphs.

    The KV cache is one tensor ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``.
    The attention backend is chosen once, here (``select_attention_backend``: Triton kernels on
    CUDA in fp16/bf16, the C kernel on CPU in float32, torch elsewhere); on the Triton backend
    CUDA graphs are captured here, after the cache exists (``weir.engine.cuda_graphs``): full
    graphs for decode-only steps, piecewise graphs for the other steps that fit a bucket.

    Args:
        model: a ``LlamaForCausalLM`` from ``weir.engine.models.llama``.
        num_blocks, block_size: cache geometry.
        device, dtype: where and in what the cache lives.
        max_num_seqs, max_model_len: size the persistent batch (it grows past them if needed) and
            the decode CUDA graphs (none are captured without them).
        enforce_eager: capture no CUDA graphs.
        cudagraph_mode: a ``CUDAGraphMode`` value.
        cudagraph_capture_sizes: the piecewise buckets (``resolve_capture_sizes``); None: none.
        measure_step_gpu_time: time each forward with CUDA events too (``CUDAGraphStats``).
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 enforce_eager: bool = False, cudagraph_mode: str = "FULL_AND_PIECEWISE",
                 cudagraph_capture_sizes: list[int] | None = None, measure_step_gpu_time: bool = False):
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers, 2, cfg.num_key_value_heads, num_blocks, block_size, head_dim,
            dtype=dtype, device=device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_hidden_layers)]
        self.graphs = self.piecewise_graphs = None
        self.structured_outputs = None  # the engine's StructuredOutputManager: fills grammar bitmasks
        self.cudagraph_summary = "no CUDA graphs"
        self.step_stats = CUDAGraphStats(measure_step_gpu_time and device.type == "cuda")
        self.input_batch = InputBatch(max_num_seqs or 1, -(-(max_model_len or block_size) // block_size), device)
        self.set_attention_backend(select_attention_backend(device, dtype))
        mode = CUDAGraphMode(cudagraph_mode)
        if not cudagraph_capture_sizes:
            mode = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full else CUDAGraphMode.NONE
        if (self.attn_backend.name == "triton" and device.type == "cuda" and not enforce_eager
                and mode is not CUDAGraphMode.NONE and max_num_seqs and max_model_len):
            self.graphs, self.piecewise_graphs, self.cudagraph_summary = build_cuda_graphs(
                model, self.attn_backend, self.kv_caches, mode, max_num_seqs, -(-max_model_len // block_size),
                block_size, cudagraph_capture_sizes, device)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Run attention (and the model's other kernels, see ``model_kernels``) on ``backend``; set at
        start-up, or by tests that drive another device's backend on CPU tensors."""
        self.attn_backend = backend
        self.model.use_kernels(backend.model_kernels)

    @property
    def use_cpu_kernel(self) -> bool:
        """True while the CPU C-kernel backend runs attention; set False for the torch reference."""
        return self.attn_backend.name == "cpu"

    @use_cpu_kernel.setter
    def use_cpu_kernel(self, enabled: bool) -> None:
        if not enabled and self.use_cpu_kernel:
            self.set_attention_backend(TorchAttentionBackend())
        elif enabled and not self.use_cpu_kernel:
            from weir.engine.attention import CpuAttentionBackend

            self.set_attention_backend(CpuAttentionBackend())

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim * elem

    def copy_block(self, src: int, dst: int) -> None:
        self.kv_cache[:, :, :, dst].copy_(self.kv_cache[:, :, :, src])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run every scheduled request's new tokens in one packed forward pass: one step-input
        build over the persistent batch, then a full CUDA-graph replay (decode-only steps),
        piecewise graph replays (other steps that fit a bucket) or an eager forward
        (:func:`weir.engine.cuda_graphs.dispatch`).

        Returns:
            Sampled tokens for requests whose tokens are all computed, and scoring log-probabilities.
        """
        num_reqs = len(sched.scheduled)
        mode = dispatch(sched, self.graphs, self.piecewise_graphs)
        padded = self.graphs.padded_size(num_reqs) if mode == FULL else None
        backend = self.attn_backend
        inputs = build_step_inputs(sched, self.block_size, self.device, backend.index_dtype,
                                   num_padded_decodes=padded, input_batch=self.input_batch)
        started = self.step_stats.start()
        if mode == FULL:
            hidden = self.graphs.replay(inputs)[:num_reqs]
            num_rows = padded
        elif mode == PIECEWISE:
            hidden = self.piecewise_graphs.run(inputs)
            num_rows = self.piecewise_graphs.padded_size(sched.num_tokens)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, backend,
                                backend.build_metadata(inputs))
            num_rows = sched.num_tokens
        self.step_stats.record(mode, sched.num_tokens, num_rows - sched.num_tokens, started)
        return self._outputs(inputs.requests, hidden)

    def _outputs(self, ordered: list[ScheduledRequest], hidden: torch.Tensor) -> ModelRunnerOutput:
        """Sample, gather log-probabilities and scores for the rows of ``hidden``
        (``[num_tokens, hidden_size]``, packed in ``ordered``'s order), with one device-to-host copy.

        Sampled-token and prompt log-probabilities share one top-k (k = the largest asked); scoring
        targets and final ids are one gather each.
        """
        out = ModelRunnerOutput()
        sample_rows, sample_reqs = [], []
        score_rows, score_targets, score_keys = [], [], []
        final_rows, final_reqs = [], []
        prompt_rows, prompt_keys = [], []
        offset = 0
        for s in ordered:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            last = offset + n - 1
            task = r.scoring
            if task is not None:
                if task.start is not None:
                    lo = max(start, task.start)
                    hi = min(start + n, task.start + len(task.targets))
                    for p in range(lo, hi):
                        score_rows.append(offset + p - start)
                        score_targets.append(task.targets[p - task.start])
                        score_keys.append((r.request_id, p - task.start))
                if s.completes_prompt and task.final_logprob_ids is not None:
                    final_rows.append(last)
                    final_reqs.append(r)
            else:
                if r.sampling_params.prompt_logprobs is not None:
                    # row of position p predicts prompt token p + 1
                    for p in range(start, min(start + n, r.num_prompt_tokens - 1)):
                        prompt_rows.append(offset + p - start)
                        prompt_keys.append((r, p + 1))
                if s.completes_prompt:
                    sample_rows.append(last)
                    sample_reqs.append(r)
            offset += n
        device = hidden.device
        transfer = HostTransfer()
        lp_logits, lp_tokens, lp_nums = [], [], []  # rows whose top log-probabilities are reported
        lp_reqs: list[int] = []  # indices into sample_reqs
        if sample_rows:
            logits = self.model.compute_logits(hidden[to_device(sample_rows, device)])
            if self.structured_outputs is not None:
                states = [r.structured_output for r in sample_reqs]
                bitmask = self.structured_outputs.grammar_bitmask(states)
                if bitmask is not None:  # reported log-probabilities are the masked ones, as in vLLM
                    rows = [i for i, s in enumerate(states) if s is not None]
                    apply_grammar_bitmask(logits, bitmask, None if len(rows) == len(states) else rows)
            rows = [SampleRow(r.sampling_params, r.generator, r.prompt_token_ids, r.output_token_ids,
                              r.eos_token_ids) for r in sample_reqs]
            tokens = sample_tokens(logits, rows)
            transfer.add(tokens)
            lp_reqs = [i for i, r in enumerate(sample_reqs) if r.sampling_params.logprobs is not None]
            if len(lp_reqs) == len(sample_reqs):
                lp_logits.append(logits)
                lp_tokens.append(tokens)
            elif lp_reqs:
                idx = to_device(lp_reqs, device)
                lp_logits.append(logits[idx])
                lp_tokens.append(tokens[idx])
            lp_nums += [sample_reqs[i].sampling_params.logprobs for i in lp_reqs]
        if prompt_rows:
            lp_logits.append(self.model.compute_logits(hidden[to_device(prompt_rows, device)]))
            lp_tokens.append(to_device([r.all_token_ids[pos] for r, pos in prompt_keys], device))
            lp_nums += [r.sampling_params.prompt_logprobs for r, _ in prompt_keys]
        if lp_logits:
            both = torch.cat(lp_logits) if len(lp_logits) > 1 else lp_logits[0]
            lp = torch.log_softmax(both.float(), dim=-1)  # [num_lp_rows, vocab]
            for t in gather_logprobs(lp, torch.cat(lp_tokens), max(lp_nums)).tensors():
                transfer.add(t)
        if score_rows:
            lp = torch.log_softmax(self.model.compute_logits(hidden[to_device(score_rows, device)]), dim=-1)
            transfer.add(lp.gather(1, to_device(score_targets, device)[:, None])[:, 0])
        if final_rows:
            lp = torch.log_softmax(self.model.compute_logits(hidden[to_device(final_rows, device)]), dim=-1)
            ids = [r.scoring.final_logprob_ids for r in final_reqs]
            width = max(map(len, ids))
            padded = to_device([i + [0] * (width - len(i)) for i in ids], device,
                               torch.long).reshape(len(ids), width)  # [num_final, width]
            transfer.add(lp.gather(1, padded))
        host = iter(transfer.fetch())
        if sample_rows:
            token_ids = next(host).tolist()
            out.sampled = {r.request_id: t for r, t in zip(sample_reqs, token_ids)}
        if lp_logits:
            lp_ids = [token_ids[i] for i in lp_reqs]
            lp_ids += [r.all_token_ids[pos] for r, pos in prompt_keys]
            entries = iter(logprob_entries(lp_ids, [next(host) for _ in range(4)], lp_nums))
            out.logprobs = {sample_reqs[i].request_id: next(entries) for i in lp_reqs}
            for r, pos in prompt_keys:
                out.prompt_logprobs.setdefault(r.request_id, {})[pos] = next(entries)
        if score_rows:
            for (rid, i), v in zip(score_keys, next(host).tolist()):
                out.score_logprobs.setdefault(rid, {})[i] = v
        if final_rows:
            for r, vals in zip(final_reqs, next(host).tolist()):
                out.final_logprobs[r.request_id] = vals[:len(r.scoring.final_logprob_ids)]
        return out
