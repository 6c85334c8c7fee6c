"""transformers' progress bars while the loader loads weights: none in a log file, tqdm's on a terminal."""

import io
import sys

from transformers import modeling_gguf_pytorch_utils as gguf_utils
from transformers.utils import logging as hf_logging

from weir.engine.loader import load_state_dict
from weir.model_source import resolve_model


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_progress_bar_when_stderr_is_not_a_terminal(monkeypatch):
    log_file = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log_file)
    bare_tqdm = gguf_utils.tqdm
    assert hf_logging.is_progress_bar_enabled()

    state_dict = load_state_dict(resolve_model(None))  # the packaged SmolLM2 GGUF

    assert state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert log_file.getvalue() == ""  # neither "Converting and de-quantizing GGUF tensors" nor "Loading weights"
    assert hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is bare_tqdm  # as they were


def test_progress_bars_on_a_terminal(monkeypatch, tiny_llama_dir):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    load_state_dict(resolve_model(tiny_llama_dir))

    assert "Loading weights: 100%" in terminal.getvalue()


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
