"""The model FLOP counter on known shapes (exact integers)."""

from __future__ import annotations

from bench.roofline import FlopCounter, ModelShape, generation_flops

SMOLLM2_135M = ModelShape(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          intermediate_size=1536, vocab_size=49152)


def test_smollm2_non_embedding_params():
    # 134,515,008 parameters in all, of which the tied embedding is 49152 x 576
    assert SMOLLM2_135M.non_embedding_params == 134_515_008 - 49152 * 576


def test_non_embedding_params_match_a_transformers_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert ModelShape.from_config(config).non_embedding_params == params


def test_attention_flops_sum_keys_over_positions():
    fc = FlopCounter(SMOLLM2_135M)
    fc.add_span(0, 3)  # queries at 0, 1, 2 read 1 + 2 + 3 keys
    fc.add_span(5, 2)  # queries at 5, 6 read 6 + 7 keys
    fc.add_span(9, 0)
    per_key = 4 * 30 * 9 * 64
    assert fc.num_tokens == 5
    assert fc.attention == per_key * (6 + 13)


def test_generation_flops_count_prompt_decode_and_logits():
    # prompt of 10 tokens, 4 of them cached, 3 output tokens: 6 prefill + 2 decode tokens, 3 logits rows
    fc = generation_flops(SMOLLM2_135M, [(10, 4, 3)])
    s = SMOLLM2_135M
    assert fc.num_tokens == 8
    assert fc.num_logit_rows == 3
    keys = (5 + 6 + 7 + 8 + 9 + 10) + (11 + 12)
    assert fc.flops == 8 * s.flops_per_token + 3 * 2 * 576 * 49152 + 4 * 30 * 9 * 64 * keys


def test_generation_bytes_count_weights_per_step_and_kv_traffic():
    from bench.roofline import generation_bytes

    s = SMOLLM2_135M
    weights = (s.non_embedding_params + 576 * 49152) * 2
    kv_token = 2 * 30 * 3 * 64 * 2
    assert (s.weight_bytes(2), s.kv_bytes_per_token(2)) == (weights, kv_token)
    # prompt 4, 3 outputs: 6 tokens computed (KV written), the prompt's KV read by its prefill,
    # decode tokens at positions 4 and 5 read 5 and 6 keys; prompt 2, 1 output: 2 + 2, no decode.
    # The longest output, 3, is the fewest decode steps, each reading the weights.
    assert generation_bytes(s, [(4, 3), (2, 1)], 2) == 3 * weights + kv_token * ((6 + 4 + 5 + 6) + (2 + 2))
