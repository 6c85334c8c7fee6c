"""Rotary embedding: Triton kernel against the torch reference, bit for bit where the hardware
rounds as torch does."""

import pytest
import torch

from tests.kernels.support import import_kernel, truncate_fp32_to_bf16

rot = import_kernel("rotary")

MAX_POSITIONS = 40


def tables(head_dim, dtype, device, seed=0):
    """Random cos/sin tables ``[MAX_POSITIONS, head_dim]`` (random rather than real angles: every
    column and both halves differ, so a wrong column or half shows)."""
    g = torch.Generator().manual_seed(seed)
    cos = torch.randn(MAX_POSITIONS, head_dim, generator=g).to(dtype).to(device)
    sin = torch.randn(MAX_POSITIONS, head_dim, generator=g).to(dtype).to(device)
    return cos, sin


def truncating_bf16_ref(qk, positions, cos_cache, sin_cache):
    """The reference's order of operations with every fp32 -> bf16 rounding done by truncation
    (dropping the low 16 bits), as Triton's CPU interpreter casts."""
    trunc = truncate_fp32_to_bf16
    half = qk.shape[-1] // 2
    x1, x2 = qk[..., :half].float(), qk[..., half:].float()
    # c1, c2, s1, s2: [num_tokens, 1, half]
    c1, c2 = cos_cache[positions].float().unsqueeze(1).split(half, dim=-1)
    s1, s2 = sin_cache[positions].float().unsqueeze(1).split(half, dim=-1)
    o1 = trunc(trunc(x1 * c1) + trunc(-x2 * s1))
    o2 = trunc(trunc(x2 * c2) + trunc(x1 * s2))
    return torch.cat((o1, o2), dim=-1).to(torch.bfloat16)


def reference(qk, positions, cos, sin):
    """What the kernel must equal bit for bit: torch's result, except bf16 under the CPU
    interpreter, whose fp32 -> bf16 cast truncates instead of rounding to nearest even."""
    if qk.dtype == torch.bfloat16 and qk.device.type == "cpu":
        return truncating_bf16_ref(qk, positions, cos, sin)
    return rot.rotary_embedding_ref(qk, positions, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(4, 2, 64), (9, 3, 64), (2, 1, 128), (3, 1, 80)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rotary_on_fused_qkv_matches_reference(device, dtype, num_q_heads, num_kv_heads, head_dim, index_dtype):
    g = torch.Generator().manual_seed(1)
    num_tokens = 6
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=g).to(dtype).to(device)
    before = qkv.clone()
    # qk: [num_tokens, num_q_heads + num_kv_heads, head_dim], a strided view of qkv
    qk = qkv[:, :(num_q_heads + num_kv_heads) * head_dim].view(num_tokens, -1, head_dim)
    cos, sin = tables(head_dim, dtype, device)
    positions = torch.tensor([5, 0, 39, 5, 17, 2], dtype=index_dtype, device=device)  # repeats, any order
    want = reference(qk, positions, cos, sin)
    got = rot.rotary_embedding(qk, positions, cos, sin)
    assert got.data_ptr() == qk.data_ptr() and got.dtype == dtype
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    # the values after q and k are left alone
    assert torch.equal(qkv[:, qk.shape[1] * head_dim:], before[:, qk.shape[1] * head_dim:])


def test_rotary_with_real_tables_keeps_norms_and_position_zero(device):
    """With transformers' tables, position 0 is the identity and every rotation keeps each pair's
    length (fp32)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=MAX_POSITIONS)
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.empty(1), torch.arange(MAX_POSITIONS)[None])
    cos, sin = cos[0].to(device), sin[0].to(device)
    x = torch.randn(3, 2, 32).to(device)
    got = rot.rotary_embedding(x.clone(), torch.tensor([0, 7, 39], device=device), cos, sin)
    assert torch.equal(got[0], x[0])
    pair_norm = lambda t: t[..., :16] ** 2 + t[..., 16:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(got), pair_norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["dtype", "odd", "positions", "table", "stride"])
def test_rotary_rejects_bad_arguments(device, bad):
    qk = torch.zeros(3, 2, 64, device=device)
    positions = torch.zeros(3, dtype=torch.int32, device=device)
    cos, sin = tables(64, torch.float32, device)
    if bad == "dtype":
        cos = cos.half()
    elif bad == "odd":
        qk, cos, sin = torch.zeros(3, 2, 63, device=device), cos[:, :63], sin[:, :63]
    elif bad == "positions":
        positions = positions[:2]
    elif bad == "table":
        cos, sin = cos[:, :32], sin[:, :32]
    elif bad == "stride":
        qk = torch.zeros(3, 2, 128, device=device)[:, :, ::2]
    with pytest.raises(ValueError):
        rot.rotary_embedding(qk, positions, cos, sin)
