"""Every tensor the sampler builds lives on the logits' device.

No GPU is needed to see a device mix-up: the logits go on the ``meta`` device and a dispatch mode
fails any operation whose (non-scalar) tensor arguments sit on more than one device, which is what
CUDA would reject.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from types import SimpleNamespace

from weir.engine.logprobs import gather_logprobs
from weir.engine.model_runner import ModelRunner
from weir.engine.request import Request, ScoringTask
from weir.engine.sampler import SampleRow, apply_penalties, filter_logits, sample, sample_tokens
from weir.engine.sampling_params import SamplingParams
from weir.engine.scheduler import ScheduledRequest

VOCAB = 32


class OneDevice(TorchDispatchMode):
    """Raises on any op that mixes devices (0-dim CPU tensors are scalars and may mix, as on CUDA)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1:
            raise AssertionError(f"{func} mixes devices {sorted(map(str, devices))}")
        if func._schema.name == "aten::exponential_" and args[0].device.type == "meta":
            return args[0]  # meta has no kernel taking a generator; a random fill reads no values
        return func(*args, **kwargs)


def test_guard_sees_a_mix():
    with pytest.raises(AssertionError, match="mixes devices"), OneDevice():
        torch.zeros(4, device="meta") - torch.ones(4)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5]),
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=1.0, presence_penalty=0.7),
    SamplingParams(temperature=1.0, frequency_penalty=0.2, presence_penalty=0.1, repetition_penalty=1.1,
                   min_tokens=4),
], ids=["min_tokens", "repetition", "frequency", "presence", "all"])
def test_penalties_stay_on_the_logits_device(params):
    rows = [SampleRow(params, None, [1, 2, 3], [4, 4, 7], frozenset({0})),
            SampleRow(params, None, [9], [], frozenset({0}))]
    logits = torch.zeros(2, VOCAB, device="meta")
    with OneDevice():
        apply_penalties(logits, rows)


def test_filters_stay_on_the_logits_device():
    logits = torch.zeros(2, VOCAB, device="meta")
    with OneDevice():
        filter_logits(logits, [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
                               SamplingParams(temperature=0)])


def test_sampling_stays_on_the_logits_device():
    g = torch.Generator().manual_seed(1)
    rows = [SampleRow(SamplingParams(temperature=0), None, [1], [2]),
            SampleRow(SamplingParams(temperature=0.8, seed=1, top_k=3, repetition_penalty=1.2), g, [1], [2]),
            SampleRow(SamplingParams(temperature=1.0, min_tokens=2, frequency_penalty=0.4), None, [1], [2],
                      frozenset({0}))]
    with OneDevice():
        sample_tokens(torch.zeros(3, VOCAB, device="meta"), rows)


# ---- one device-to-host copy per step ---------------------------------------------------------

# ops whose result depends on tensor values the meta device does not have
VALUE_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal",
             "aten::is_nonzero", "aten::_unique2", "aten::unique_consecutive"}


class HostSyncs(OneDevice):
    """:class:`OneDevice`, and counts device-to-host copies of meta tensors (``_to_copy``/``copy_``
    to the CPU, which ``.cpu()`` and ``.tolist()`` do), answering them with zeros so the host code can
    go on; raises on any op that needs a meta tensor's values (``.item()``, ``nonzero``, boolean
    indexing ...). With ``strict=False`` a scalar read (``.item()``, ``int(t)``, ``float(t)``) is
    counted as a transfer too and answered with 0, so that code syncing per row can be counted
    (``bench/sampler.py`` counts the row-by-row sampler so)."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict = strict
        self.num_transfers = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name == "aten::_local_scalar_dense" and not self.strict:
            self.num_transfers += 1
            return False if args[0].dtype == torch.bool else 0
        if name in VALUE_OPS:
            raise AssertionError(f"{func} reads tensor values on the host")
        if name == "aten::_to_copy" and args[0].device.type == "meta" and kwargs.get("device") == torch.device("cpu"):
            self.num_transfers += 1
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if name == "aten::copy_" and args[0].device.type == "cpu" and args[1].device.type == "meta":
            self.num_transfers += 1
            return args[0].zero_()
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_sync_guard_counts_and_refuses_values():
    with HostSyncs() as mode:
        assert torch.ones(3, device="meta").cpu().tolist() == [0.0, 0.0, 0.0]
    assert mode.num_transfers == 1
    with pytest.raises(AssertionError, match="reads tensor values"), HostSyncs():
        torch.ones(3, device="meta").sum().item()
    with HostSyncs(strict=False) as mode:
        assert int(torch.ones(3, device="meta").sum()) == 0
    assert mode.num_transfers == 1
    with HostSyncs() as mode:  # .tolist() copies to the host first: counted
        torch.ones(3, device="meta").tolist()
    assert mode.num_transfers == 1
    with pytest.raises((AssertionError, NotImplementedError), match="nonzero"), HostSyncs():
        x = torch.ones(3, device="meta")
        x[x > 0]


class MetaModel:
    """Only what ``ModelRunner._outputs`` calls: fp32 logits from a meta lm_head."""

    def __init__(self, vocab: int, hidden_size: int):
        self.lm_head_weight = torch.zeros(vocab, hidden_size, device="meta")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.lm_head_weight).float()


def mixed_step():
    """A step holding greedy, seeded and unseeded rows with every filter and penalty, logprobs=5,
    a prompt with prompt_logprobs and two scoring requests; (scheduled requests, num_tokens)."""
    gen = lambda seed: torch.Generator().manual_seed(seed)
    default = torch.Generator().manual_seed(0)
    sps = [
        (SamplingParams(temperature=0, logprobs=5), None),
        (SamplingParams(temperature=0.7, seed=3, top_k=5, top_p=0.9, min_p=0.05, logprobs=5), gen(3)),
        (SamplingParams(temperature=1.0, top_p=0.8, repetition_penalty=1.2, frequency_penalty=0.3,
                        presence_penalty=0.1), default),
        (SamplingParams(temperature=1.1, min_tokens=4, stop_token_ids=[7], logprobs=2), default),
        (SamplingParams(temperature=0.9, seed=5, min_p=0.1, repetition_penalty=0.8, logprobs=0), gen(5)),
    ]
    scheduled = []
    for k, (sp, g) in enumerate(sps):
        r = Request(f"gen-{k}", [3, 4, 5, 6], sp, frozenset({2}))
        r.generator = g
        for t in (9, 9, 11):
            r.append_output_token(t)
        r.num_computed_tokens = r.num_tokens - 1
        scheduled.append(ScheduledRequest(r, 1))
    prompt = Request("prompt", [3, 4, 5, 6, 7, 8], SamplingParams(temperature=0, prompt_logprobs=3), frozenset({2}))
    scheduled.append(ScheduledRequest(prompt, 6))
    score = Request("score", [3, 4, 5, 6, 7], SamplingParams(), scoring=ScoringTask(1, [5, 6, 7], [9, 10]))
    scheduled.append(ScheduledRequest(score, 5))
    final = Request("final", [3, 4], SamplingParams(), scoring=ScoringTask(None, [], [1, 2, 3]))
    scheduled.append(ScheduledRequest(final, 2))
    return scheduled, sum(s.num_new_tokens for s in scheduled)


def test_a_mixed_step_copies_to_the_host_once():
    scheduled, num_tokens = mixed_step()
    runner = SimpleNamespace(model=MetaModel(VOCAB, 8), structured_outputs=None)
    hidden = torch.zeros(num_tokens, 8, device="meta")
    with HostSyncs() as mode:
        out = ModelRunner._outputs(runner, scheduled, hidden)
    assert mode.num_transfers == 1
    # the host still builds every output from the (zero) values it got back
    assert sorted(out.sampled) == [f"gen-{k}" for k in range(5)] + ["prompt"]
    assert [len(out.logprobs[f"gen-{k}"]) for k in (0, 1, 3, 4)] == [6, 6, 3, 1]
    assert sorted(out.prompt_logprobs["prompt"]) == [1, 2, 3, 4, 5]
    assert all(len(e) == 4 for e in out.prompt_logprobs["prompt"].values())
    assert out.score_logprobs == {"score": {0: 0.0, 1: 0.0, 2: 0.0}}
    assert out.final_logprobs == {"final": [0.0, 0.0, 0.0], "score": [0.0, 0.0]}


def test_sample_copies_to_the_host_once():
    scheduled, _ = mixed_step()
    rows = [SampleRow(s.request.sampling_params, s.request.generator, s.request.prompt_token_ids,
                      s.request.output_token_ids, s.request.eos_token_ids) for s in scheduled[:5]]
    with HostSyncs() as mode:
        out = sample(torch.zeros(5, VOCAB, device="meta"), rows)
    assert mode.num_transfers == 1 and out.token_ids == [0] * 5


@pytest.mark.parametrize("num_top", [0, 3])
def test_logprob_gather_stays_on_the_logits_device(num_top):
    with HostSyncs() as mode:
        gather_logprobs(torch.zeros(4, VOCAB, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"),
                        num_top)
    assert mode.num_transfers == 0


def test_every_generation_row_with_logprobs_next_to_prompt_logprobs():
    gen = Request("gen", [3, 4, 5], SamplingParams(temperature=0, logprobs=2))
    gen.num_computed_tokens = 2
    prompt = Request("prompt", [3, 4, 5, 6], SamplingParams(temperature=0, logprobs=1, prompt_logprobs=3))
    scheduled = [ScheduledRequest(gen, 1), ScheduledRequest(prompt, 4)]
    with HostSyncs() as mode:
        out = ModelRunner._outputs(SimpleNamespace(model=MetaModel(VOCAB, 8), structured_outputs=None), scheduled,
                                   torch.zeros(5, 8, device="meta"))
    assert mode.num_transfers == 1
    assert {rid: len(e) for rid, e in out.logprobs.items()} == {"gen": 3, "prompt": 2}
    assert {pos: len(e) for pos, e in out.prompt_logprobs["prompt"].items()} == {1: 4, 2: 4, 3: 4}
