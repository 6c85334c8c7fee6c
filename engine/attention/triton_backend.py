"""The Triton attention backend: the kernels of ``weir.kernels`` (CUDA, fp16/bf16).

Decode rows go to ``paged_attention_decode``, prefill rows to ``prefill_attention``; both read
keys/values through the block table only, and ``write_kv_cache`` skips slot -1. Building the
metadata takes views of the step's common fields and launches nothing, so the same call serves
an eager step and the static buffers of a CUDA graph. The model's residual add + RMSNorm, rotary
embedding and SwiGLU run as the kernels of ``weir.kernels.rms_norm``, ``.rotary`` and ``.activation``
(``model_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weir.engine.step_inputs import StepInputs


@dataclass
class TritonAttentionMetadata:
    """Views of :class:`StepInputs` split at ``num_decodes``.

    Attributes:
        slot_mapping: ``[num_tokens]``; -1 writes nothing (CUDA-graph padding).
        decode_block_table, decode_seq_lens: ``[num_decodes, max_num_blocks]``, ``[num_decodes]``.
        prefill_block_table, prefill_seq_lens: the same for the prefill requests.
        prefill_query_start_loc: ``[num_prefills + 1]``, starting at the first prefill row.
        max_query_len: the longest prefill chunk (a host int), 0 without prefills.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefill_block_table: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_seq_lens: torch.Tensor
    max_query_len: int


class TritonAttentionBackend:
    """Triton kernels for cache writes, decode and prefill attention."""

    name = "triton"
    index_dtype = torch.int32
    model_kernels = True

    @staticmethod
    def build_metadata(inputs: StepInputs) -> TritonAttentionMetadata:
        nd = inputs.num_decodes
        has_prefills = inputs.num_reqs > nd
        return TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping, num_decodes=nd,
            decode_block_table=inputs.block_table[:nd], decode_seq_lens=inputs.seq_lens[:nd],
            prefill_block_table=inputs.block_table[nd:], prefill_query_start_loc=inputs.query_start_loc[nd:],
            prefill_seq_lens=inputs.seq_lens[nd:], max_query_len=inputs.max_query_len if has_prefills else 0,
        )

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: TritonAttentionMetadata) -> None:
        from weir.kernels.kv_cache import write_kv_cache

        write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)

    @staticmethod
    def forward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        key_cache: torch.Tensor, value_cache: torch.Tensor, meta: TritonAttentionMetadata, scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Same arguments and result as ``TorchAttentionBackend.forward`` (``sliding_window`` included)."""
        from weir.kernels.paged_attention import paged_attention_decode
        from weir.kernels.prefill_attention import prefill_attention

        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            paged_attention_decode(query[:nd], key_cache, value_cache, meta.decode_block_table,
                                   meta.decode_seq_lens, scale, out=out[:nd], sliding_window=sliding_window)
        if meta.max_query_len:
            prefill_attention(query, key_cache, value_cache, meta.prefill_block_table,
                              meta.prefill_query_start_loc, meta.prefill_seq_lens, meta.max_query_len,
                              scale, out=out, sliding_window=sliding_window)
        return out
