"""The step-mix prediction: the real scheduler with a stub forward, each step's mode as the runner
dispatches it."""

from bench.mixed import SHAPES, w_mixed_requests
from bench.step_mix import capture_estimate, predict_seconds, simulate, summarize
from bench.roofline import ModelShape

# a 40-token prompt (3 outputs) and a 10-token one (2 outputs), 32 tokens a step, 4 sequences
REQUESTS = [(list(range(3, 43)), 3), (list(range(3, 13)), 2)]


def test_each_step_is_dispatched_as_the_runner_would():
    """Step 1: 32 tokens of the long prompt (bucket 32); step 2: its last 8 beside the short
    prompt's 10 (18 tokens, bucket 32: 14 padding rows); steps 3 and 4: decodes of 2, then 1."""
    assert simulate(REQUESTS, max_num_seqs=4, max_num_batched_tokens=32, cap=32) == [
        ("piecewise", 32, 1, 32, 32), ("piecewise", 18, 2, 32, 50), ("full", 2, 2, 2, 52), ("full", 1, 1, 1, 42)]
    # a cap of 16: the two prompt steps do not fit a bucket
    assert [s[0] for s in simulate(REQUESTS, 4, 32, cap=16)] == ["eager", "eager", "full", "full"]
    assert {s[0] for s in simulate(REQUESTS, 4, 32, cap=None)} == {"eager"}


def test_summary_counts_steps_tokens_and_padding():
    mix = summarize(simulate(REQUESTS, 4, 32, cap=32))
    assert mix == {"full": {"num_steps": 2, "num_tokens": 3, "num_padding_tokens": 0},
                   "piecewise": {"num_steps": 2, "num_tokens": 50, "num_padding_tokens": 14},
                   "eager": {"num_steps": 0, "num_tokens": 0, "num_padding_tokens": 0}}


def test_w_mixed_at_256_sequences_leaves_the_135m_shape_mostly_eager_under_a_512_cap():
    requests = w_mixed_requests(512, SHAPES["smollm2-135m"]["vocab_size"])
    at_512 = summarize(simulate(requests, 256, 8192, cap=512))
    at_2048 = summarize(simulate(requests, 256, 8192, cap=2048))
    assert sum(m["num_steps"] for m in at_512.values()) == 442
    assert (at_512["eager"]["num_steps"], at_512["eager"]["num_tokens"]) == (121, 175689)
    assert (at_2048["eager"]["num_steps"], at_2048["full"]["num_steps"]) == (9, 299)


def test_predicted_host_time_is_what_graphs_save():
    shape = ModelShape(576, 30, 9, 3, 64, 1536, 49152)
    eager = predict_seconds(simulate(REQUESTS, 4, 32, cap=None), shape)
    graphs = predict_seconds(simulate(REQUESTS, 4, 32, cap=32), shape)
    assert sum(graphs["host"].values()) < sum(eager["host"].values()) / 5
    assert sum(graphs["device"].values()) > 0
    big, small = capture_estimate(2048, 256, shape), capture_estimate(512, 256, shape)
    assert big["num_piecewise_graphs"] == big["num_piecewise_buckets"] * 31 > small["num_piecewise_graphs"]
    assert big["pool_bytes"] == 4 * small["pool_bytes"]
