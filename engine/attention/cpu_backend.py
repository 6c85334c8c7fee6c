"""The CPU attention backend: the C kernel of ``weir.kernels.cpu_paged_attention`` (float32).

The C kernel computes one query token at a time against its paged context: best for decodes and
short chunks over a prefix (label forks, sample forks). So the leading requests of the packed
step (the decodes, then chunks over a prefix of at most :data:`MAX_KERNEL_CHUNK` tokens, which
the step packs shortest first) go to the kernel as one varlen batch; longer chunks over a prefix
and fresh prompts are matrix work and take the torch backend's batched SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weir.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from weir.engine.step_inputs import StepInputs

# longest chunk over a cached prefix that the C kernel takes (longer ones: batched SDPA)
MAX_KERNEL_CHUNK = 16


@dataclass
class VarlenBatch:
    """The step's first ``num_tokens`` tokens, run by the C kernel.

    Attributes:
        block_table: ``[num_seqs, max_num_blocks]`` int64.
        token_seq: ``[num_tokens]`` int64 row of ``block_table`` per token.
        token_ctx: ``[num_tokens]`` int64 positions each token sees (its position + 1).
        max_ctx: ``max(token_ctx)``.
    """

    num_tokens: int
    block_table: torch.Tensor
    token_seq: torch.Tensor
    token_ctx: torch.Tensor
    max_ctx: int


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """:class:`TorchAttentionMetadata` of the rows after ``varlen``, plus the kernel's rows."""

    varlen: VarlenBatch | None = None


class CpuAttentionBackend(TorchAttentionBackend):
    """The C kernel for decodes and short chunks over a prefix, torch SDPA for the rest."""

    name = "cpu"

    def build_metadata(self, inputs: StepInputs) -> CpuAttentionMetadata:
        loc, seq_lens = inputs.query_start_loc_cpu, inputs.seq_lens_cpu
        meta = CpuAttentionMetadata(inputs.slot_mapping, inputs.num_actual_tokens, inputs=inputs)
        # the kernel's requests: decodes, then chunks over a prefix while they are short
        end = inputs.num_decodes
        while end < inputs.num_reqs:
            n = loc[end + 1] - loc[end]
            if n > MAX_KERNEL_CHUNK or seq_lens[end] == n:
                break
            end += 1
        if end:
            token_seq: list[int] = []
            token_ctx: list[int] = []
            for i in range(end):
                n = loc[i + 1] - loc[i]
                token_seq.extend([i] * n)
                token_ctx.extend(range(seq_lens[i] - n + 1, seq_lens[i] + 1))
            dev = inputs.slot_mapping.device
            meta.varlen = VarlenBatch(
                num_tokens=loc[end], block_table=inputs.block_table[:end],
                token_seq=torch.tensor(token_seq, dtype=torch.long, device=dev),
                token_ctx=torch.tensor(token_ctx, dtype=torch.long, device=dev),
                max_ctx=max(seq_lens[:end]),
            )
        self._add_prefills(meta, inputs, end)
        return meta

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        key_cache: torch.Tensor, value_cache: torch.Tensor, meta: CpuAttentionMetadata, scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Same arguments and result as :meth:`TorchAttentionBackend.forward` (float32 CPU tensors)."""
        from weir.kernels.cpu_paged_attention import paged_attention_varlen

        out = torch.empty_like(query)
        v = meta.varlen
        if v is not None:
            out[:v.num_tokens] = paged_attention_varlen(query[:v.num_tokens], key_cache, value_cache,
                                                        v.block_table, v.token_seq, v.token_ctx, scale, v.max_ctx,
                                                        sliding_window=sliding_window)
        self._forward_torch(out, query, key, value, key_cache, value_cache, meta, scale, sliding_window)
        return out
