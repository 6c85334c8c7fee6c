"""Runs one scheduled step on the model: packs inputs, owns the KV cache, samples."""

from __future__ import annotations

import torch

from weir.engine.attention import AttentionMetadata, ContextPrefillBatch, PrefillSeq, VarlenMeta, use_kernels
from weir.engine.sampler import SampleRow, sample, top_logprobs
from weir.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from weir.engine.step_inputs import build_kernel_step
from weir.kernels.cpu_paged_attention import is_available as cpu_kernel_available


class ModelRunner:
    """Owns the model and the KV cache tensors.

    The KV cache is one tensor ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``.
    On CUDA in fp16/bf16 the step runs the Triton kernels (``use_kernels``) and decode-only steps
    replay CUDA graphs captured here; elsewhere it runs the torch reference attention.

    Args:
        model: a ``LlamaForCausalLM`` from ``weir.engine.models.llama``.
        num_blocks, block_size: cache geometry.
        device, dtype: where and in what the cache lives.
        max_num_seqs, max_model_len: size the decode CUDA graphs (none are captured without them).
        enforce_eager: capture no CUDA graphs.
    """

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 enforce_eager: bool = False):
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
        self.use_kernels = use_kernels(device, dtype)
        self.use_cpu_kernel = device.type == "cpu" and dtype == torch.float32 and cpu_kernel_available()
        self.graphs = None
        if self.use_kernels and not enforce_eager and max_num_seqs and max_model_len:
            from weir.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(model, self.kv_caches, max_num_seqs, max_blocks, device)

    @staticmethod
    def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim * elem

    def copy_block(self, src: int, dst: int) -> None:
        self.kv_cache[:, :, :, dst].copy_(self.kv_cache[:, :, :, src])

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run every scheduled request's new tokens in one packed forward pass.

        Returns:
            Sampled tokens for requests whose tokens are all computed, and scoring log-probabilities.
        """
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ordered: list[ScheduledRequest] = decodes + prefills
        if self.use_kernels:
            return self._outputs(ordered, self._forward_kernels(decodes, prefills))
        # packed order: decodes, short chunks over a prefix (CPU kernel, when built), longer chunks
        # over a prefix (one batched SDPA), fresh prompts (causal SDPA each)
        short = [s for s in prefills if self._uses_cpu_kernel(s)]
        rest = [s for s in prefills if not self._uses_cpu_kernel(s)]
        with_prefix = [s for s in rest if s.request.num_computed_tokens]
        fresh = [s for s in rest if not s.request.num_computed_tokens]
        ordered = decodes + short + with_prefix + fresh
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in ordered:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            input_ids.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(r.block_table, start, end))
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev))
        offset = 0
        if self.use_cpu_kernel:
            offset = self._varlen_meta(meta, decodes + short)
        elif decodes:
            self._decode_meta(meta, decodes)
            offset = len(decodes)
        if with_prefix:
            meta.context_prefills = self._context_batch(with_prefix, offset)
            offset += sum(s.num_new_tokens for s in with_prefix)
        for s in fresh:
            meta.prefills.append(PrefillSeq(offset, s.num_new_tokens))
            offset += s.num_new_tokens
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches, meta,
        )
        return self._outputs(ordered, hidden)

    # the CPU kernel computes one query token at a time: best for decodes and short chunks (label
    # forks, sample forks); longer chunks over a prefix are matrix work for SDPA
    MAX_CPU_KERNEL_CHUNK = 16

    def _uses_cpu_kernel(self, s: ScheduledRequest) -> bool:
        """A prefill chunk short enough for the CPU kernel (decodes are always its)."""
        return self.use_cpu_kernel and s.request.num_computed_tokens > 0 and (
            s.num_new_tokens <= self.MAX_CPU_KERNEL_CHUNK)

    @staticmethod
    def _padded_block_tables(seqs: list[ScheduledRequest], device) -> torch.Tensor:
        """``[len(seqs), max_num_blocks]`` int64 block tables, padded with block 0."""
        nb = max(len(s.request.block_table) for s in seqs)
        return torch.tensor([s.request.block_table + [0] * (nb - len(s.request.block_table)) for s in seqs],
                            dtype=torch.long, device=device)

    def _varlen_meta(self, meta: AttentionMetadata, seqs: list[ScheduledRequest]) -> int:
        """CPU kernel inputs for ``seqs`` (the step's first tokens): each token's sequence row and
        visible length. Returns the number of tokens it covers."""
        token_seq: list[int] = []
        token_ctx: list[int] = []
        for i, s in enumerate(seqs):
            start = s.request.num_computed_tokens
            token_seq.extend([i] * s.num_new_tokens)
            token_ctx.extend(range(start + 1, start + s.num_new_tokens + 1))
        if seqs:
            dev = self.device
            meta.varlen = VarlenMeta(
                num_tokens=len(token_seq),
                block_tables=self._padded_block_tables(seqs, dev),
                token_seq=torch.tensor(token_seq, dtype=torch.long, device=dev),
                token_ctx=torch.tensor(token_ctx, dtype=torch.long, device=dev),
                max_ctx=max(token_ctx),
            )
        return len(token_seq)

    def _context_batch(self, chunks: list[ScheduledRequest], offset: int) -> ContextPrefillBatch:
        """One padded batch of prefill chunks over a cached prefix, packed from row ``offset``."""
        dev = self.device
        max_q = max(s.num_new_tokens for s in chunks)
        max_ctx = max(s.request.num_computed_tokens + s.num_new_tokens for s in chunks)
        rows, valid, slots, starts, ctx = [], [], [], [], []
        for s in chunks:
            n, start = s.num_new_tokens, s.request.num_computed_tokens
            rows.append(list(range(offset, offset + n)) + [0] * (max_q - n))
            valid.append([True] * n + [False] * (max_q - n))
            slots.append(self._slots(s.request.block_table, 0, start + n) + [0] * (max_ctx - start - n))
            starts.append(start)
            ctx.append(start + n)
            offset += n
        valid_t = torch.tensor(valid, device=dev)
        # key j is visible to query i iff j <= start + i; padding queries see key 0 only
        q_pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(max_q, device=dev)[None, :]
        q_pos = torch.where(valid_t, q_pos, 0)
        mask = torch.arange(max_ctx, device=dev)[None, None, :] <= q_pos[:, :, None]
        return ContextPrefillBatch(torch.tensor(rows, dtype=torch.long, device=dev), valid_t,
                                   torch.tensor(slots, dtype=torch.long, device=dev), mask[:, None])

    def _decode_meta(self, meta: AttentionMetadata, decodes: list[ScheduledRequest]) -> None:
        """Inputs of the torch reference decode attention: block tables and context masks."""
        dev = self.device
        meta.num_decode_tokens = len(decodes)
        ctx = [s.request.num_computed_tokens + 1 for s in decodes]
        valid = torch.arange(max(ctx), device=dev)[None, :] < torch.tensor(ctx, device=dev)[:, None]
        meta.decode_block_tables = self._padded_block_tables(decodes, dev)
        meta.decode_context_mask = valid[:, None, None, :]

    def _forward_kernels(self, decodes: list[ScheduledRequest],
                         prefills: list[ScheduledRequest]) -> torch.Tensor:
        """The Triton path: one packed int32 input copy, then a CUDA-graph replay (decode-only
        steps) or an eager forward. Returns ``[num_tokens, hidden_size]``."""
        padded = None
        if self.graphs is not None and not prefills:
            padded = self.graphs.padded_size(len(decodes))
        step = build_kernel_step(decodes, prefills, self.block_size, self.device, num_padded_decodes=padded)
        if padded is not None:
            return self.graphs.replay(step)[:len(decodes)]
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)

    def _outputs(self, ordered: list[ScheduledRequest], hidden: torch.Tensor) -> ModelRunnerOutput:
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
        if sample_rows:
            logits = self.model.compute_logits(hidden[sample_rows])
            rows = [SampleRow(r.sampling_params, r.generator, r.prompt_token_ids, r.output_token_ids,
                              r.eos_token_ids) for r in sample_reqs]
            result = sample(logits, rows)
            out.sampled = {r.request_id: t for r, t in zip(sample_reqs, result.token_ids)}
            out.logprobs = {r.request_id: lp for r, lp in zip(sample_reqs, result.logprobs) if lp is not None}
        if prompt_rows:
            lp = torch.log_softmax(self.model.compute_logits(hidden[prompt_rows]).float(), dim=-1)
            for row, (r, pos) in zip(lp, prompt_keys):
                entry = top_logprobs(row, r.all_token_ids[pos], r.sampling_params.prompt_logprobs)
                out.prompt_logprobs.setdefault(r.request_id, {})[pos] = entry
        if score_rows:
            lp = torch.log_softmax(self.model.compute_logits(hidden[score_rows]), dim=-1)
            vals = lp.gather(1, torch.tensor(score_targets, device=lp.device)[:, None])[:, 0].tolist()
            for (rid, i), v in zip(score_keys, vals):
                out.score_logprobs.setdefault(rid, {})[i] = v
        if final_rows:
            lp = torch.log_softmax(self.model.compute_logits(hidden[final_rows]), dim=-1)
            for row, r in zip(lp, final_reqs):
                out.final_logprobs[r.request_id] = row[r.scoring.final_logprob_ids].tolist()
        return out
