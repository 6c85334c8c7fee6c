"""Which layers of a checkpoint attend through a sliding window, read from its transformers config
the way transformers' own model for that ``model_type`` reads it.

The window convention is transformers' (``masking_utils.sliding_window_overlay``): with window
``W`` the query at position ``p`` sees the keys at positions ``p - W + 1 .. p``, itself included.

- ``mistral``: every layer uses ``sliding_window`` (None: global). ``MistralConfig`` defaults it to
  4096; ``MistralForCausalLM`` ignores ``layer_types`` (it warns), so this does too.
- A config with ``layer_types`` (Qwen2/Qwen3, where ``use_sliding_window`` and
  ``max_window_layers`` decide them; Gemma 3): ``sliding_attention`` layers use ``sliding_window``,
  ``full_attention`` layers are global.
- Anything else (``llama``): every layer is global; ``LlamaForCausalLM`` reads no window.
"""

from __future__ import annotations

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_sliding_windows(config) -> list[int | None]:
    """One entry per layer: its window in tokens, or None for global attention.

    Raises:
        ValueError: one line naming the config key the engine cannot honour: a window that is not
            a positive integer, a ``sliding_attention`` layer without ``sliding_window``, a layer
            type other than the two above, or ``use_bidirectional_attention``.
    """
    num_layers = config.num_hidden_layers
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported: weir's attention is causal")
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        windows = [window] * num_layers
    elif getattr(config, "layer_types", None) is not None:
        types = list(config.layer_types)
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; weir runs {list(LAYER_TYPES)}")
        if "sliding_attention" in types and window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        windows = [window if t == "sliding_attention" else None for t in types]
    else:
        return [None] * num_layers
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r} is not a positive number of tokens")
    return windows
