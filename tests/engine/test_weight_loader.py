"""Weights streamed from the files: each tensor equals transformers' own, the engine built from them
generates transformers' greedy tokens, and no second copy of the model is held while loading."""

import io
import json
import os
import sys
import weakref

import pytest
import torch

from tests.conftest import hf_greedy
from weir.engine import LLM, SamplingParams
from weir.engine.weight_loader import checkpoint_files, iter_weights
from weir.model_source import resolve_model

PROMPTS = [[5, 9, 200, 31, 7], list(range(3, 40))]
FAMILIES = ["llama-untied", "llama-tied", "qwen2-untied", "qwen2-tied"]
FORMATS = ["safetensors", "bin"]

def tiny_gguf_writer(path, architecture):
    """A GGUF writer with the metadata of the tiny test models (hidden 32, 2 layers, 4:2 heads,
    vocab 64); the caller adds the tensors."""
    import gguf

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(64)])
    return writer



def random_model(family: str):
    """A tiny random transformers model; Qwen2 has q/k/v biases (random, so a dropped one shows)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    name, head = family.split("-")
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if name == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     bos_token_id=1, eos_token_id=2, tie_word_embeddings=head == "tied")
    torch.manual_seed(FAMILIES.index(family))
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    return model


def save(model, folder, fmt: str) -> None:
    """Save in shards: safetensors by ``save_pretrained`` (40 KB shards), ``.bin`` by hand in three
    shards with their index, as transformers wrote them before version 5 (it writes no ``.bin`` now)."""
    if fmt == "safetensors":
        model.save_pretrained(folder, max_shard_size="40KB")
        return
    model.config.save_pretrained(folder)
    names = sorted(expected_names(model))
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"pytorch_model-{i + 1:05d}-of-00003.bin"
        torch.save({name: model.state_dict()[name].clone() for name in shard}, os.path.join(folder, file_name))
        weight_map.update(dict.fromkeys(shard, file_name))
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module", params=[(f, fmt) for f in FAMILIES for fmt in FORMATS], ids=lambda p: "-".join(p))
def saved(request, tmp_path_factory):
    """``(transformers model, folder, format)``: the model saved in shards (:func:`save`)."""
    family, fmt = request.param
    model = random_model(family)
    folder = tmp_path_factory.mktemp(f"{family}-{fmt}")
    save(model, folder, fmt)
    return model, str(folder), fmt


def expected_names(model) -> set[str]:
    """The state dict's names less a tied head, which the files do not hold."""
    names = set(model.state_dict())
    return names - {"lm_head.weight"} if model.config.tie_word_embeddings else names


def test_every_streamed_tensor_equals_the_state_dict(saved):
    model, folder, fmt = saved
    state_dict = model.state_dict()
    files = checkpoint_files(folder)
    assert len(files) > 1 and all(f.endswith(f".{fmt}") for f in files)  # sharded, in that format

    streamed = list(iter_weights(resolve_model(folder)))

    names = [name for name, _ in streamed]
    assert len(names) == len(set(names)) and set(names) == expected_names(model)
    for name, tensor in streamed:
        assert tensor.dtype == torch.float32 and torch.equal(tensor, state_dict[name]), name


def test_the_engine_generates_transformers_greedy_tokens(saved):
    model, folder, _ = saved
    want = [hf_greedy(model, p, 8, eos_token_id=2) for p in PROMPTS]

    llm = LLM(folder, skip_tokenizer_init=True, num_gpu_blocks_override=32)

    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))]
    assert got == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_at_most_two_streamed_tensors_are_alive_while_loading(fmt, tmp_path):
    """The loader drops each tensor once it is copied: when a tensor is yielded, only it and the
    one before it (still bound to the consumer's loop variable) are alive, never the whole model."""
    from weir.engine.models.llama import LlamaForCausalLM

    model = random_model("llama-untied")
    save(model, tmp_path, fmt)
    engine_model = LlamaForCausalLM(model.config, torch.float32, 16)
    yielded: list[weakref.ref] = []
    most_alive = 0

    def watched():
        nonlocal most_alive
        for name, tensor in iter_weights(resolve_model(str(tmp_path))):
            yielded.append(weakref.ref(tensor))
            most_alive = max(most_alive, sum(ref() is not None for ref in yielded))
            yield name, tensor
            del tensor  # this frame's reference; the consumer's is its own

    engine_model.load_weights(watched())

    assert len(yielded) == len(model.state_dict())
    assert most_alive == 2


def test_a_folder_without_weights_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no weights: neither model.safetensors nor pytorch_model.bin"):
        list(iter_weights(resolve_model(str(tmp_path))))


@pytest.mark.integration
def test_the_packaged_gguf_streams_transformers_tensors(monkeypatch):
    """SmolLM2's Q4_1 GGUF de-quantized tensor by tensor: the names and fp32 values transformers'
    ``from_pretrained(gguf_file=...)`` loads (q/k un-permuted), written with nothing on a log file."""
    from transformers import AutoModelForCausalLM

    src = resolve_model(None)
    log_file = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log_file)
    streamed = dict(iter_weights(src))
    assert log_file.getvalue() == ""
    monkeypatch.undo()

    hf = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    state_dict = hf.state_dict()
    assert hf.config.tie_word_embeddings and set(streamed) == set(state_dict) - {"lm_head.weight"}
    assert len(streamed) == 272 and os.path.basename(src.location) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for name, tensor in streamed.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, state_dict[name]), name


def test_no_init_weights_skips_torch_init_and_restores_it():
    from weir.engine.weight_loader import no_init_weights

    untouched = torch.zeros(4)
    with no_init_weights():
        torch.nn.init.normal_(untouched)
        torch.nn.init.kaiming_uniform_(untouched.view(2, 2))
    assert torch.equal(untouched, torch.zeros(4))
    torch.nn.init.normal_(untouched)
    assert not torch.equal(untouched, torch.zeros(4))  # torch's own again


def test_transformers_first_imported_inside_no_init_weights_keeps_torch_init():
    """transformers records torch's init functions when its init module is first imported; an
    import inside the context must not record the no-ops (a fresh interpreter: this one has
    imported it already)."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from weir.engine.weight_loader import no_init_weights\n"
            "with no_init_weights():\n"
            "    from transformers.initialization import TORCH_INIT_FUNCTIONS\n"
            "assert TORCH_INIT_FUNCTIONS['constant_'] is torch.nn.init.constant_\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def write_tiny_qwen2_gguf(folder) -> tuple[object, str]:
    """A tiny random Qwen2 (q/k/v biases, untied head) written as an F32 GGUF under llama.cpp's
    tensor names; returns ``(transformers model, path)``."""
    import numpy as np
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    pieces = [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
              ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
              ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")]
    for i in range(cfg.num_hidden_layers):
        for hf_piece, gguf_piece in pieces:
            for kind in ("weight", "bias"):
                gguf_names[f"model.layers.{i}.{hf_piece}.{kind}"] = f"blk.{i}.{gguf_piece}.{kind}"
    path = os.path.join(folder, "tiny-qwen2.F32.gguf")
    writer = tiny_gguf_writer(path, "qwen2")
    for name, tensor in model.state_dict().items():
        writer.add_tensor(gguf_names[name], tensor.detach().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


def test_a_qwen2_gguf_streams_its_biases_and_untied_head(tmp_path):
    from transformers import AutoModelForCausalLM

    model, path = write_tiny_qwen2_gguf(tmp_path)
    src = resolve_model(path)

    streamed = dict(iter_weights(src))

    hf = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32).state_dict()
    assert set(streamed) == set(hf) == set(model.state_dict()) and "lm_head.weight" in streamed
    for name, tensor in streamed.items():
        assert torch.equal(tensor, hf[name]) and torch.equal(tensor, model.state_dict()[name]), name


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_ggufs_stream_transformers_tensors(architecture, tmp_path):
    """A tiny random model written as an F32 GGUF as llama.cpp writes it (Gemma's norm weights
    stored plus one; names from transformers' map): the streamed tensors are transformers' own
    from ``from_pretrained(gguf_file=...)`` and the model's (the norm offset undone exactly: the
    norm weights are multiples of 1/64)."""
    import numpy as np
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

    from weir.engine.weight_loader import gguf_to_hf_names

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if architecture == "qwen3" else (
        Gemma3TextConfig, Gemma3ForCausalLM)
    cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)  # head_dim: the config's default
    torch.manual_seed(0)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randint(-64, 64, p.shape) / 64 if "norm" in name else torch.randn(p.shape))
    to_gguf = {hf_name: gguf_name for gguf_name, hf_name in gguf_to_hf_names(cfg).items()}
    path = os.path.join(tmp_path, f"tiny-{architecture}.F32.gguf")
    writer = tiny_gguf_writer(path, architecture)
    state_dict = model.state_dict()
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stored = tensor + 1 if architecture == "gemma3" and "norm.weight" in name else tensor
        writer.add_tensor(to_gguf[name], stored.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    src = resolve_model(path)

    streamed = dict(iter_weights(src))

    hf = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32).state_dict()
    assert set(streamed) == expected_names(model) and set(hf) == set(state_dict)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, hf[name]) and torch.equal(tensor, state_dict[name]), name


def test_the_gguf_name_map_is_built_once_per_config_then_read_from_the_cache(tmp_path, monkeypatch):
    """transformers' GGUF-to-transformers name map is kept on disk per config: the next load builds
    no ``meta`` model (and imports no modeling module); another config builds its own."""
    from transformers import Qwen3Config

    from weir import gguf_metadata
    from weir.engine import weight_loader

    monkeypatch.setattr(gguf_metadata, "CACHE_DIR", str(tmp_path / "cache"))
    built = []
    build = weight_loader._gguf_to_hf_names
    monkeypatch.setattr(weight_loader, "_gguf_to_hf_names",
                        lambda config, processor: built.append(config.num_hidden_layers) or build(config, processor))

    def config(num_layers):
        return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

    names = weight_loader.gguf_to_hf_names(config(2))
    assert names["blk.1.attn_q.weight"] == "model.layers.1.self_attn.q_proj.weight"
    assert names["blk.0.attn_q_norm.weight"] == "model.layers.0.self_attn.q_norm.weight"
    assert len(names) == 2 * 11 + 3 and built == [2]
    assert weight_loader.gguf_to_hf_names(config(2)) == names and built == [2]  # read from the file
    deeper = weight_loader.gguf_to_hf_names(config(3))
    assert built == [2, 3] and deeper["blk.2.ffn_down.weight"] == "model.layers.2.mlp.down_proj.weight"
