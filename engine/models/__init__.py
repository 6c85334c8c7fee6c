"""Model classes weir runs, by transformers ``model_type``.

``MODEL_CLASSES`` is the one registry: ``LLMEngine`` builds its model from it and
``weir.engine.loader.check_config`` refuses any ``model_type`` not in it. A ``gemma3`` (image and text) checkpoint runs as its
``gemma3_text`` language model (``weir.engine.loader.language_config``).
"""

from weir.engine.models.gemma3 import Gemma3ForCausalLM
from weir.engine.models.llama import LlamaForCausalLM
from weir.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}
