"""The rotary tables the engine builds itself equal, bit for bit, those transformers' rotary modules
return, for every rope type the engine accepts and for Gemma 3's per-layer-type tables."""

import pytest
import torch

from weir.engine.models.layers import rope_cos_sin

MAX_POSITIONS = 300
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default, another base": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rope", ROPES.values(), ids=list(ROPES))
def test_llama_family_tables_equal_transformers(rope, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**SIZES, rope_parameters=dict(rope))
    want_cos, want_sin = LlamaRotaryEmbedding(config)(torch.empty(1, dtype=dtype),
                                                      torch.arange(MAX_POSITIONS).unsqueeze(0))
    cos, sin = rope_cos_sin(config, MAX_POSITIONS, dtype)
    assert cos.shape == sin.shape == (MAX_POSITIONS, 16) and cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


def test_a_head_dim_apart_from_hidden_size_over_heads_is_used():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(**SIZES, head_dim=32)  # 64 / 4 would be 16
    want_cos, want_sin = Qwen3RotaryEmbedding(config)(torch.empty(1), torch.arange(MAX_POSITIONS).unsqueeze(0))
    cos, sin = rope_cos_sin(config, MAX_POSITIONS, torch.float32)
    assert cos.shape == (MAX_POSITIONS, 32)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "linear global rope"])
def test_gemma3_per_layer_type_tables_equal_transformers(scaled):
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": ({"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0} if scaled
                                          else {"rope_type": "default", "rope_theta": 1000000.0})}
    config = Gemma3TextConfig(**SIZES, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters=rope_parameters)
    module = Gemma3RotaryEmbedding(config)
    for layer_type in ("sliding_attention", "full_attention"):
        want_cos, want_sin = module(torch.empty(1), torch.arange(MAX_POSITIONS).unsqueeze(0), layer_type)
        cos, sin = rope_cos_sin(config, MAX_POSITIONS, torch.float32, layer_type=layer_type)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), layer_type
    local, global_ = (rope_cos_sin(config, MAX_POSITIONS, torch.float32, layer_type=t)[0]
                      for t in ("sliding_attention", "full_attention"))
    assert not torch.equal(local, global_)  # one table per layer type, not one for all


def test_building_a_model_imports_no_transformers_modeling_module():
    """A family's modeling module (``modeling_llama``: about 2 s to import) is not needed for its tables."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from transformers import LlamaConfig\n"
            "from weir.engine.models.llama import LlamaForCausalLM\n"
            f"LlamaForCausalLM(LlamaConfig(**{SIZES!r}), torch.float32, 64)\n"
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m\n"
            "             and not m.startswith('transformers.models.auto.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
