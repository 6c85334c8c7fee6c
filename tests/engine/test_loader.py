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
