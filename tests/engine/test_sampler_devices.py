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

from weir.engine.sampler import SampleRow, apply_penalties, filter_logits
from weir.engine.sampling_params import SamplingParams

VOCAB = 32


class OneDevice(TorchDispatchMode):
    """Raises on any op that mixes devices (0-dim CPU tensors are scalars and may mix, as on CUDA)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1:
            raise AssertionError(f"{func} mixes devices {sorted(map(str, devices))}")
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
    row = torch.zeros(VOCAB, device="meta")
    with OneDevice():
        filter_logits(row, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05))
