"""transformers' GGUF metadata parse, shared within a process and kept on disk: the same config and
tokenizer as a fresh parse, one parse per file, and a new parse when the file changes."""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import transformers.modeling_gguf_pytorch_utils as gguf_utils

from weir import gguf_metadata
from weir.engine.loader import load_config
from weir.model_source import default_model_path, encode_prompt, load_tokenizer, resolve_model

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a red fruit."}]
TEXT = "Stainless steel water bottle, 750 ml, ₹499 — keeps drinks cold for 24 hours."


@pytest.fixture
def parses(tmp_path, monkeypatch):
    """The cache in a temporary folder, and the list of files transformers itself parses."""
    monkeypatch.setattr(gguf_metadata, "CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    parse = gguf_utils.load_gguf_checkpoint

    def counted(path, return_tensors=False, *args, **kwargs):
        calls.append(os.path.basename(path))
        return parse(path, return_tensors, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    yield calls
    assert gguf_utils.load_gguf_checkpoint is counted  # restored by every shared_gguf_parse()


def _config_dict(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}  # the copy has its own


def _load(src):
    with gguf_metadata.shared_gguf_parse():
        config = load_config(src)
        tokenizer = load_tokenizer(src, config.vocab_size)
    return _config_dict(config), [encode_prompt(tokenizer, p) for p in (TEXT, CHAT)], tokenizer.get_vocab()


@pytest.fixture(scope="module")
def fresh():
    """Config, encodings and vocabulary of the packaged model as transformers alone loads them."""
    src = resolve_model(None)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(src.path, **src.hf_kwargs())
    tokenizer = AutoTokenizer.from_pretrained(src.path, **src.hf_kwargs())
    return _config_dict(config), [encode_prompt(tokenizer, p) for p in (TEXT, CHAT)], tokenizer.get_vocab()


def test_one_parse_per_file_then_none_from_the_cache(parses, fresh, tmp_path):
    src = resolve_model(None)
    assert _load(src) == fresh
    assert parses == [os.path.basename(default_model_path())]  # config and tokenizer shared one
    assert len(os.listdir(tmp_path / "cache")) == 1
    assert _load(src) == fresh  # another "process": nothing held in memory, read from the file
    assert len(parses) == 1


def test_a_changed_file_is_parsed_again(parses, fresh, tmp_path):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), copy)
    src = resolve_model(str(copy))
    assert _load(src) == fresh
    os.utime(copy, ns=(os.stat(copy).st_atime_ns, os.stat(copy).st_mtime_ns + 1_000_000_000))
    assert _load(src) == fresh
    assert parses == ["model.gguf", "model.gguf"]
    assert len(os.listdir(tmp_path / "cache")) == 2


def test_a_damaged_or_unwritable_cache_is_passed_by(parses, fresh, tmp_path, monkeypatch):
    src = resolve_model(None)
    _load(src)
    (cached,) = (tmp_path / "cache").iterdir()
    cached.write_text('{"key": [1], "parse": {"config": {}}}')  # another file's key
    assert _load(src) == fresh
    cached.write_text("{not json")
    assert _load(src) == fresh
    assert len(parses) == 3
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(gguf_metadata, "CACHE_DIR", str(blocked / "cache"))  # cannot be made
    assert _load(src) == fresh
    assert len(parses) == 4


def test_the_parse_is_restored_when_a_load_fails(parses):
    with pytest.raises(RuntimeError):
        with gguf_metadata.shared_gguf_parse():
            with gguf_metadata.shared_gguf_parse():
                assert gguf_utils.load_gguf_checkpoint is not gguf_utils.load_gguf_checkpoint.transformers_parse
            raise RuntimeError("load failed")


def test_a_file_replaced_with_its_mtime_kept_is_parsed_again(parses, fresh, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), path)
    src = resolve_model(str(path))
    _load(src)
    stat = os.stat(path)
    shutil.copyfile(default_model_path(), tmp_path / "new.gguf")  # same size, e.g. another quantization's
    os.replace(tmp_path / "new.gguf", path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p, rsync -t and tar keep it
    assert _load(src) == fresh
    assert parses == ["model.gguf", "model.gguf"]


def test_threads_loading_one_file_wait_for_one_parse(parses, fresh):
    src = resolve_model(None)
    barrier = threading.Barrier(4)

    def load(_):
        barrier.wait()
        return _load(src)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(load, range(4))) == [fresh] * 4
    assert len(parses) == 1


def test_a_hugging_face_folder_loads_without_transformers_gguf_module(tiny_model_dir):
    """The shared parse is for GGUF files: an engine on a Hugging Face folder never imports
    transformers' GGUF module (about 0.5 s of every load)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from weir.engine.llm import LLM\n"
            f"LLM({tiny_model_dir!r}, num_gpu_blocks_override=64)\n"
            "print('transformers.modeling_gguf_pytorch_utils' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
