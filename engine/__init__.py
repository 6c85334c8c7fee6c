"""weir's inference engine: vLLM's offline API over a paged, continuously batched KV cache.

Public API::

    from weir.engine import LLM, SamplingParams, EngineFront   # LLM and SamplingParams: also `from weir import`
    llm = LLM(model=None)                # None: the packaged SmolLM2-135M-Instruct GGUF
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    cls = llm.classify(["Is water wet?"], ["yes", "no"])
    front = EngineFront(llm)             # thread-safe: one background step loop
    fut = front.submit_generate(prompt, params)   # -> concurrent.futures.Future[RequestOutput]
"""

from weir.engine.openmp import limit_omp_spinning

limit_omp_spinning()  # before torch loads: GNU OpenMP reads it once (weir.engine.openmp)

from weir.engine.outputs import ClassificationOutput, CompletionOutput, RequestOutput
from weir.engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "EngineFront",
    "EngineStepError",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "ClassificationOutput",
]


def __getattr__(name):  # lazy: importing engine must not pull torch for light users
    if name == "LLM":
        from weir.engine.llm import LLM

        return LLM
    if name == "EngineFront":
        from weir.engine.front import EngineFront

        return EngineFront
    if name == "EngineStepError":
        from weir.engine.llm_engine import EngineStepError

        return EngineStepError
    raise AttributeError(name)
