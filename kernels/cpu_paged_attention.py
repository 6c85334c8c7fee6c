"""Paged attention on the CPU: a small C kernel (OpenMP), built with the system C compiler on
first use and loaded with ctypes.

One call covers every query token that attends to keys/values already in the paged cache: decode
tokens (one per request) and prefill chunks over a cached prefix (chunked prefill, prefix-cache
hits, classification label forks). Keys are read in place through the block table, never gathered
into a dense copy (PagedAttention, Kwon et al. 2023); each (token, KV head) pair computes the scores
of its query heads, a softmax, then the weighted sum of values (two passes over the context).

When no compiler is available the caller falls back to the torch reference
(:func:`paged_attention_varlen_ref`), which is also what the tests compare against.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void paged_attention_varlen_f32(
    const float* q, float* out, const float* k_cache, const float* v_cache,
    const int64_t* block_tables, const int64_t* token_seq, const int64_t* token_ctx,
    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t num_blocks, int64_t max_blocks, int64_t max_ctx, int64_t window,
    float scale, int num_threads)
{
    const int64_t G = num_heads / num_kv_heads;
    const int64_t D = head_dim;
    const int64_t head_stride = num_blocks * block_size * D;
    #pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)malloc(sizeof(float) * G * (max_ctx > 0 ? max_ctx : 1));
        #pragma omp for schedule(dynamic, 8)
        for (int64_t w = 0; w < num_tokens * num_kv_heads; ++w) {
            const int64_t t = w / num_kv_heads, h = w % num_kv_heads;
            const int64_t L = token_ctx[t];
            // a sliding window of W keys: positions [L - W, L) only; earlier blocks are never read
            const int64_t S = (window > 0 && L > window) ? L - window : 0;
            const int64_t N = L - S;
            const int64_t* bt = block_tables + token_seq[t] * max_blocks;
            const float* qh = q + (t * num_heads + h * G) * D;
            const float* kh = k_cache + h * head_stride;
            const float* vh = v_cache + h * head_stride;
            float* o = out + (t * num_heads + h * G) * D;
            for (int64_t j0 = S; j0 < L; ) {
                const int64_t off = j0 % block_size;
                const float* kb = kh + bt[j0 / block_size] * block_size * D;
                const int64_t n = (L - j0 < block_size - off) ? L - j0 : block_size - off;
                for (int64_t j = 0; j < n; ++j) {
                    const float* kj = kb + (off + j) * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float* qg = qh + g * D;
                        float acc = 0.f;
                        #pragma omp simd reduction(+:acc)
                        for (int64_t d = 0; d < D; ++d) acc += qg[d] * kj[d];
                        scores[g * N + j0 - S + j] = acc * scale;
                    }
                }
                j0 += n;
            }
            for (int64_t g = 0; g < G; ++g) {
                float* s = scores + g * N;
                float m = -INFINITY;
                for (int64_t j = 0; j < N; ++j) m = s[j] > m ? s[j] : m;
                float z = 0.f;
                for (int64_t j = 0; j < N; ++j) { s[j] = expf(s[j] - m); z += s[j]; }
                const float inv = 1.f / z;
                for (int64_t j = 0; j < N; ++j) s[j] *= inv;
            }
            memset(o, 0, sizeof(float) * G * D);
            for (int64_t j0 = S; j0 < L; ) {
                const int64_t off = j0 % block_size;
                const float* vb = vh + bt[j0 / block_size] * block_size * D;
                const int64_t n = (L - j0 < block_size - off) ? L - j0 : block_size - off;
                for (int64_t j = 0; j < n; ++j) {
                    const float* vj = vb + (off + j) * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float p = scores[g * N + j0 - S + j];
                        float* og = o + g * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) og[d] += p * vj[d];
                    }
                }
                j0 += n;
            }
        }
        free(scores);
    }
}
"""

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "weir", "kernels")


def _machine_key() -> str:
    # -march=native code is only valid on the CPU it was built for
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256((_SOURCE + flags).encode()).hexdigest()[:16]


def load_library() -> Optional[ctypes.CDLL]:
    """Build (once per machine, cached under ``~/.cache/weir/kernels``) and load the kernel.

    Returns:
        The loaded library, or None when no C compiler is found or the build fails (logged).
    """
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("WEIR_DISABLE_CPU_KERNELS"):
            return None
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            logger.warning("no C compiler found: CPU paged attention uses the torch reference")
            return None
        path = os.path.join(_cache_dir(), f"paged_attention_{_machine_key()}.so")
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "paged_attention.c")
                with open(src, "w") as f:
                    f.write(_SOURCE)
                built = os.path.join(tmp, "paged_attention.so")
                cmd = [cc, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", src, "-o", built, "-lm"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    logger.warning("building the CPU attention kernel failed (%s); using the torch "
                                   "reference", proc.stderr.strip()[:500])
                    return None
                os.replace(built, path)  # atomic: concurrent builders never load a partial file
        lib = ctypes.CDLL(path)
        fn = lib.paged_attention_varlen_f32
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int]
        _lib = lib
        return _lib


def is_available() -> bool:
    return load_library() is not None


def _check(query, key_cache, value_cache, block_tables, token_seq, token_ctx):
    if query.dtype != torch.float32 or key_cache.dtype != torch.float32 or value_cache.dtype != torch.float32:
        raise TypeError("query and caches must be float32")
    if query.device.type != "cpu":
        raise ValueError("CPU kernel given tensors on " + str(query.device))
    for name, t in (("block_tables", block_tables), ("token_seq", token_seq), ("token_ctx", token_ctx)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("query must be [num_tokens, num_heads, head_dim] and caches "
                         "[num_kv_heads, num_blocks, block_size, head_dim]")
    if query.shape[1] % key_cache.shape[0] or query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(key_cache.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if token_seq.shape != (query.shape[0],) or token_ctx.shape != (query.shape[0],):
        raise ValueError("token_seq and token_ctx must be [num_tokens]")


def _window_arg(sliding_window: Optional[int]) -> int:
    """The kernel's ``window`` argument: 0 for none. Raises ValueError below 1."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return int(sliding_window)


def paged_attention_varlen(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, token_seq: torch.Tensor, token_ctx: torch.Tensor, scale: float,
    max_ctx: Optional[int] = None, sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Attention of query tokens over their contexts in the paged cache (float32, CPU).

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float32; query head ``i`` reads KV head
            ``i // (num_heads // num_kv_heads)`` (grouped-query attention).
        key_cache, value_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]`` float32,
            contiguous.
        block_tables: ``[num_seqs, max_blocks]`` int64 block ids of each sequence.
        token_seq: ``[num_tokens]`` int64, the row of ``block_tables`` each token belongs to.
        token_ctx: ``[num_tokens]`` int64 >= 1, how many positions the token sees (its own
            position + 1: causal).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_ctx: ``max(token_ctx)`` when the caller knows it (saves a reduction).
        sliding_window: None (every position) or ``W >= 1``: a token that sees ``L`` positions
            attends to the last ``min(L, W)`` of them only, positions ``L - W .. L - 1`` (the
            convention of transformers' sliding-window masks: key ``k`` is visible to query
            ``q`` iff ``q - W < k <= q``). Block-table entries of blocks wholly before that range
            are never read, so they may hold any value (a block freed from a request).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` float32.

    Raises:
        TypeError, ValueError: wrong dtypes, devices or shapes. RuntimeError: kernel unavailable.
    """
    _check(query, key_cache, value_cache, block_tables, token_seq, token_ctx)
    lib = load_library()
    if lib is None:
        raise RuntimeError("CPU attention kernel is not available")
    q = query.contiguous()
    bt = block_tables.contiguous()
    out = torch.empty_like(q)
    if max_ctx is None:
        max_ctx = int(token_ctx.max()) if token_ctx.numel() else 0
    kvh, nb, bs, hd = key_cache.shape
    lib.paged_attention_varlen_f32(
        q.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), bt.data_ptr(),
        token_seq.data_ptr(), token_ctx.data_ptr(), q.shape[0], q.shape[1], kvh, hd, bs, nb,
        bt.shape[1], max_ctx, _window_arg(sliding_window), float(scale), torch.get_num_threads(),
    )
    return out


def paged_attention_varlen_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, token_seq: torch.Tensor, token_ctx: torch.Tensor, scale: float,
    max_ctx: Optional[int] = None, sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Plain torch version of :func:`paged_attention_varlen` (same arguments and result), one
    token at a time in fp32, rounded to ``query``'s dtype. Slow; it is the oracle of the tests.

    It is the one torch reference of attention over the paged cache: the Triton kernels'
    references (``paged_attention_decode_ref``, ``prefill_attention_ref``) map their arguments onto
    it. So it takes any float dtype and device, and ``token_ctx`` 0 gives a zero row (a decode
    padding row: the weighted sum over no values). ``max_ctx`` is ignored. With ``sliding_window``
    it reads only the blocks holding the window's positions, as the kernel does.
    """
    kvh, _, bs, hd = key_cache.shape
    group = query.shape[1] // kvh
    window = _window_arg(sliding_window)
    out = torch.empty_like(query)
    for t, (seq, n) in enumerate(zip(token_seq.tolist(), token_ctx.tolist())):
        start = n - window if 0 < window < n else 0
        first = start // bs
        blocks = block_tables[seq, first: -(-n // bs)].long()
        # k, v: [num_heads, n - start, head_dim], each KV head repeated for its query heads
        k = key_cache[:, blocks].reshape(kvh, -1, hd)[:, start - first * bs:n - first * bs]
        v = value_cache[:, blocks].reshape(kvh, -1, hd)[:, start - first * bs:n - first * bs]
        k = k.float().repeat_interleave(group, 0)
        v = v.float().repeat_interleave(group, 0)
        # s: [num_heads, 1, n], query [num_heads, 1, head_dim] against k (n = 0: the product is zeros)
        s = (query[t].float()[:, None, :] @ k.transpose(1, 2)) * scale
        out[t] = (s.softmax(-1) @ v)[:, 0].to(out.dtype)
    return out
