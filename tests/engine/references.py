"""transformers' greedy tokens for the packaged real models, recorded once and kept as test data
(``tests/data/references/<name>.json``), so the real-model parity tests compare weir against
transformers without building transformers' model and generating with it on every run (minutes on
a CPU). ``tests/engine/test_smollm2.py`` still runs transformers itself on a few of the prompts, so
a record that no longer matches the installed transformers fails there.

    python -m tests.engine.references            # records every reference again

Each file holds ``transformers`` (the version that recorded it), ``max_tokens``, ``prompts`` (token
ids, as weir encodes them) and ``tokens`` (transformers' greedy new tokens per prompt, fp32, stopped
at the model's end-of-sequence tokens).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from tests.conftest import hf_greedy

REFERENCE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "references")


def reference_path(name: str) -> str:
    return os.path.join(REFERENCE_DIR, f"{name}.json")


def read_reference(name: str) -> dict[str, Any]:
    """The record ``name`` (``smollm2``, ``gemma3_270m``): ``{"transformers", "max_tokens",
    "prompts", "tokens"}``."""
    with open(reference_path(name), encoding="utf-8") as f:
        return json.load(f)


def hf_model(path: str):
    """transformers' own model of ``path`` (a GGUF file or a model folder), fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    from weir.engine.weight_loader import memoised_gguf_name_table
    from weir.gguf_metadata import shared_gguf_parse
    from weir.model_source import resolve_model

    src = resolve_model(path)
    # the same model, loaded faster: transformers' config parse and GGUF name table done once
    with shared_gguf_parse(), memoised_gguf_name_table():
        return AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **src.hf_kwargs()).eval()


def hf_tokens(model, prompts: list[list[int]], max_tokens: int, eos_token_ids) -> list[list[int]]:
    with torch.no_grad():
        return [hf_greedy(model, p, max_tokens, eos_token_id=sorted(eos_token_ids)) for p in prompts]


def record(name: str, path: str, prompts_of: Callable[[Any], list[list[int]]], max_tokens: int) -> None:
    """Writes ``name``'s record: ``prompts_of(llm)`` encoded by weir's ``LLM`` on ``path``, and
    transformers' greedy tokens for them."""
    import transformers

    from weir.engine import LLM

    llm = LLM(path, dtype="float32", max_model_len=1024)
    prompts = prompts_of(llm)
    tokens = hf_tokens(hf_model(path), prompts, max_tokens, llm.llm_engine.eos_token_ids)
    os.makedirs(REFERENCE_DIR, exist_ok=True)
    with open(reference_path(name), "w", encoding="utf-8") as f:
        json.dump({"transformers": transformers.__version__, "max_tokens": max_tokens, "prompts": prompts,
                   "tokens": tokens}, f)
        f.write("\n")
    print(f"{name}: {len(prompts)} prompts -> {reference_path(name)}")


def main() -> None:
    from tests.engine import test_gemma3_270m, test_smollm2
    from weir.model_source import default_model_path

    record("smollm2", default_model_path(), test_smollm2.prompts_of, test_smollm2.MAX_TOKENS)
    record("gemma3_270m", test_gemma3_270m.gemma3_path(), test_gemma3_270m.prompts_of, test_gemma3_270m.MAX_TOKENS)


if __name__ == "__main__":
    main()
