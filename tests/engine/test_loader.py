"""Loading a checkpoint: nothing drawn on a log file, each fused slice filled, bad weights named."""

import io
import sys

from weir.engine import LLM


def test_loading_writes_no_progress_bar_to_a_log_file(monkeypatch, tiny_llama_dir):
    log_file = io.StringIO()  # not a terminal: a progress bar here would be every redraw
    monkeypatch.setattr(sys, "stderr", log_file)

    LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=16)

    assert log_file.getvalue() == ""


def test_load_weights_fills_each_fused_slice_from_its_checkpoint_piece(tiny_hf_model):
    import torch

    from weir.engine.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_hf_model.config, torch.float32, 16)
    sd = tiny_hf_model.state_dict()
    model.load_weights(sd.items())
    layer = model.layers[1]
    q, k, v = layer.qkv_proj.weight.split(layer.qkv_sizes)
    assert torch.equal(q, sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, sd["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, sd["model.layers.1.self_attn.v_proj.weight"])
    gate, up = layer.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, sd["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(up, sd["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])


def test_load_weights_names_a_missing_an_unknown_and_a_misshapen_weight(tiny_hf_model):
    import pytest
    import torch

    from weir.engine.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_hf_model.config, torch.float32, 16)
    sd = dict(tiny_hf_model.state_dict())
    without_v = {k: t for k, t in sd.items() if k != "model.layers.0.self_attn.v_proj.weight"}
    with pytest.raises(KeyError, match="checkpoint has no weight 'model.layers.0.self_attn.v_proj.weight'\"$"):
        model.load_weights(without_v.items())
    with pytest.raises(KeyError, match="'model.layers.0.self_attn.rope_proj.weight' has no parameter"):
        model.load_weights([("model.layers.0.self_attn.rope_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"has shape \(3,\), the model expects \(64,\)"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])
