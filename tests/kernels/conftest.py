"""Kernel tests run the real Triton kernels on CUDA, and Triton's CPU interpreter elsewhere.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test module
imports a ``weir.kernels`` Triton module. The engine imports those only when it runs on CUDA, so
tests of the engine's CPU path collected in the same process are unaffected.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
