"""Kernels of the engine: Triton kernels for CUDA (decode and prefill paged attention, KV-cache
writes, RMSNorm with the fused residual add, rotary embedding of queries and keys, SwiGLU) and a C
kernel for paged attention on the CPU.

Each operation has one plain torch reference, named ``<operation>_ref`` beside the kernel, which
the kernel tests compare against. The two Triton attention kernels share one K/V tile loop
(``weir.kernels.common.attend_paged_context``) and one reference
(``weir.kernels.cpu_paged_attention.paged_attention_varlen_ref``). The engine's torch path
(``weir.engine.attention``) runs where no kernel is available."""
