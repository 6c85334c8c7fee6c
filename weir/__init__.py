"""weir: a self-hosted batch LLM inference worker.

The engine's offline API (vLLM's names)::

    from weir import LLM, SamplingParams
    llm = LLM(model=None)          # None: the packaged SmolLM2-135M-Instruct GGUF
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))

Producers use :mod:`weir.jobs` (``Client``, ``GenerateRequest``, ``ClassifyRequest``); the Celery
app is ``weir.worker.app`` (``celery -A weir.worker.app worker``). Importing ``weir`` is light:
torch is imported only when ``LLM`` is first used.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from weir.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from weir.engine import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'weir' has no attribute {name!r}")
