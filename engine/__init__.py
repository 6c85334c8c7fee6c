"""weir's inference engine: vLLM's offline API over a paged, continuously batched KV cache.

Public API::

    from engine import LLM, SamplingParams, EngineFront
    llm = LLM(model=None)                # None: the packaged SmolLM2-135M-Instruct GGUF
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    cls = llm.classify(["Is water wet?"], ["yes", "no"])
    front = EngineFront(llm)             # thread-safe: one background step loop
    fut = front.submit_generate(prompt, params)   # -> concurrent.futures.Future[RequestOutput]
"""

from engine.outputs import ClassificationOutput, CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineFront",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "ClassificationOutput",
]


def __getattr__(name):  # lazy: importing engine must not pull torch for light users
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "EngineFront":
        from engine.front import EngineFront

        return EngineFront
    raise AttributeError(name)
