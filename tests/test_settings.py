"""The engine's knobs are defined once, in ``EngineArgs``; the settings (``WEIR_*``) mirror them."""

from __future__ import annotations

import dataclasses
import os
import typing

import pytest
import torch

from weir.config import CacheSettings, EngineSettings, Settings
from weir.engine.engine_args import DEVICES, DTYPE_ALIASES, LOAD_FORMATS, EngineArgs, normalize_dtype

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENGINE_ARGS_ONLY = {
    # A worker must tokenize text prompts and the client counts their tokens: a worker without a
    # tokenizer would fail every text job, so the settings offer no way to skip it.
    "skip_tokenizer_init",
}
SETTINGS_ONLY: set[str] = set()  # every engine or cache setting is an engine argument
DEFAULTS_DIFFER = {
    # The environment cannot hold None: an empty WEIR_MODEL means the packaged model, and
    # Settings.engine_args() turns "" into EngineArgs' None.
    "model": ("", None),
    # A worker serves interactive jobs beside bulk ones: it runs them first, strictly (vLLM's and
    # the offline LLM's default is fcfs); None resolves to True with the priority policy.
    "scheduling_policy": ("priority", "fcfs"),
    "strict_priority": (None, False),
}


def _settings_fields() -> dict:
    fields = dict(EngineSettings.model_fields)
    fields.update(CacheSettings.model_fields)
    return fields


def test_every_engine_argument_is_a_setting_and_back():
    args = {f.name for f in dataclasses.fields(EngineArgs)}
    settings = set(_settings_fields())
    assert args - settings == ENGINE_ARGS_ONLY
    assert settings - args == SETTINGS_ONLY


def test_defaults_agree():
    args = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    for name, field in _settings_fields().items():
        if name in DEFAULTS_DIFFER:
            assert (field.default, args[name]) == DEFAULTS_DIFFER[name]
        else:
            assert field.default == args[name], name


def test_default_settings_build_the_default_engine_args():
    assert EngineArgs(**Settings().engine_args()) == EngineArgs(scheduling_policy="priority", strict_priority=True)


def test_strict_priority_follows_the_policy_unless_set():
    assert (EngineSettings().strict_priority, EngineSettings(scheduling_policy="fcfs").strict_priority,
            EngineSettings(strict_priority=False).strict_priority) == (True, False, False)
    with pytest.raises(ValueError, match="true needs WEIR_SCHEDULING_POLICY=priority"):
        EngineSettings(scheduling_policy="fcfs", strict_priority=True)


def test_choices_agree():
    fields = _settings_fields()
    assert typing.get_args(fields["load_format"].annotation) == LOAD_FORMATS
    assert typing.get_args(fields["device"].annotation) == DEVICES


def test_environment_reaches_the_engine_arguments(monkeypatch):
    monkeypatch.setenv("WEIR_ENFORCE_EAGER", "1")
    monkeypatch.setenv("WEIR_MAX_LOGPROBS", "5")
    monkeypatch.setenv("WEIR_DTYPE", "half")
    monkeypatch.setenv("WEIR_BLOCK_SIZE", "32")
    args = EngineArgs(**Settings().engine_args())
    assert (args.enforce_eager, args.max_logprobs, args.dtype, args.block_size) == (True, 5, "float16", 32)


def test_every_setting_is_documented():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    missing = [
        f"WEIR_{name.upper()}"
        for group in Settings.model_fields.values()
        for name in group.annotation.model_fields
        if f"`WEIR_{name.upper()}`" not in readme
    ]
    assert missing == []


@pytest.mark.parametrize(
    "given, canonical",
    [
        ("auto", "auto"),
        ("half", "float16"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("BFloat16", "bfloat16"),
        ("float", "float32"),
        ("float32", "float32"),
        (torch.float16, "float16"),
        (torch.bfloat16, "bfloat16"),
        (torch.float32, "float32"),
    ],
)
def test_vllm_dtype_names(given, canonical):
    assert normalize_dtype(given) == canonical
    assert EngineArgs(dtype=given).dtype == canonical
    assert EngineSettings(dtype=str(given).removeprefix("torch.")).dtype == canonical


@pytest.mark.parametrize("given", ["fp16", "int8", "", torch.int8])
def test_unknown_dtype_names_the_accepted_ones(given):
    with pytest.raises(ValueError, match="is not one of auto, half, float16, bfloat16, bf16, float, float32"):
        EngineArgs(dtype=given)


def test_dtype_aliases_are_vllms():
    assert list(DTYPE_ALIASES) == ["auto", "half", "float16", "bfloat16", "bf16", "float", "float32"]
