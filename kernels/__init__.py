"""Kernels of the engine: Triton kernels for CUDA (decode and prefill paged attention, KV-cache
writes, RMSNorm with the fused residual add, rotary embedding of queries and keys, SwiGLU) and a C
kernel for paged attention on the CPU.

Each operation has one plain torch reference, named ``<operation>_ref`` beside the kernel, which
the kernel tests compare against. The two Triton attention kernels share one K/V tile loop
(``weir.kernels.common.attend_paged_context``) and one reference
(``weir.kernels.cpu_paged_attention.paged_attention_varlen_ref``). The engine's torch path
(``weir.engine.attention``) runs where no kernel is available."""

if __name__ == "kernels":
    # This folder imported by its own name: the repository root is on sys.path (``python -m pytest``
    # and ``python -c`` from a checkout put it there) and ``import kernels`` found it before an
    # installed distribution of that name, which transformers (5.25 and later) imports. weir's
    # kernels are ``weir.kernels``; hand the name over to the installed ``kernels`` if there is one.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _repo_root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _spec = _machinery.PathFinder.find_spec(  # realpath: the root may be on sys.path through a symlink too
        "kernels", [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _repo_root])
    if _spec is None:
        raise ImportError("weir's kernels folder is imported as weir.kernels, not as kernels",
                          name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds now
    _spec.loader.exec_module(_module)
