"""Streams a checkpoint's weights from its files, one tensor at a time, named as transformers names
them (``model.layers.0.self_attn.q_proj.weight`` ...), for ``*ForCausalLM.load_weights``.

No transformers model is built with real storage: a safetensors file is memory-mapped
(``safetensors.safe_open``) and read tensor by tensor, a ``pytorch_model*.bin`` is opened with
``torch.load(mmap=True)``, and a GGUF file (its tensor index read by :mod:`weir.gguf_file`,
memory-mapped) is de-quantized tensor by tensor with ``gguf.quants.dequantize``. While the caller
copies each tensor into its parameter, memory holds the model plus one checkpoint tensor, not a
second copy of the model.

GGUF names and layouts are transformers' own (``transformers.modeling_gguf_pytorch_utils``): its
GGUF-to-transformers name map, computed on a model built on the ``meta`` device (no storage), and
its per-architecture tensor processor (Llama's q/k reverse permutation, Gemma's norm-weight
offset), applied to each tensor as ``from_pretrained(gguf_file=...)`` applies it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from typing import Iterator, Optional

import torch

from weir.gguf_file import read_tensors
from weir.gguf_metadata import cached_json, shared_gguf_parse
from weir.model_source import ModelSource

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
PT_INDEX = "pytorch_model.bin.index.json"
PT_FILE = "pytorch_model.bin"

# general.architecture of the GGUF files the engine's model classes take
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


def iter_weights(src: ModelSource, config=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight of a checkpoint, as ``(transformers_name, tensor)``, read from the files one
    tensor at a time.

    Args:
        src: a Hugging Face folder (``model.safetensors``, sharded with
            ``model.safetensors.index.json`` or single; else ``pytorch_model.bin``, sharded or
            single) or a GGUF file.
        config: the model's transformers config; for GGUF, read from the file when None (folders
            do not need it).

    Yields:
        ``(name, tensor)`` on the CPU: the checkpoint's dtype for a folder (a view of the
        memory-mapped file for ``.bin``), fp32 for GGUF (de-quantized). A tied LM head is not
        yielded when the file does not hold one.

    Raises:
        FileNotFoundError: a folder with neither safetensors nor ``pytorch_model*.bin`` weights.
        ValueError: a GGUF file whose architecture is not one of :data:`GGUF_ARCHITECTURES`.
    """
    if src.gguf_file:
        yield from _iter_gguf(src, config)
    else:
        for path in checkpoint_files(src.path):
            yield from (_iter_safetensors(path) if path.endswith(".safetensors") else _iter_pt(path))


@contextlib.contextmanager
def no_init_weights() -> Iterator[None]:
    """While building a model whose every weight is then loaded, skip torch's random initialisation
    of its parameters (``torch.nn.init``'s in-place functions, which ``nn.Linear`` and
    ``nn.Embedding`` call, do nothing): a 1B-parameter model is built in milliseconds instead of
    seconds, its parameters left uninitialised until ``load_weights`` (which raises on a missing
    weight) or ``init_dummy`` fills them. Buffers computed in the constructor (RoPE tables) and
    parameters created with values (``torch.ones``) are unaffected. Not thread-safe: it swaps module
    attributes of ``torch.nn.init`` for the duration."""
    from torch.nn import init

    # transformers' own init module keeps the torch functions it finds when first imported; were
    # that import to happen inside this context (a model class importing its transformers module
    # for its RoPE tables), every transformers model built later in the process would keep the
    # no-ops below and be left uninitialised (Gemma 3's embed_scale buffer: garbage logits)
    with contextlib.suppress(ImportError):
        import transformers.initialization  # noqa: F401

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    originals = {n: getattr(init, n) for n in names}
    for n in names:
        setattr(init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(init, n, fn)


def checkpoint_files(folder: str) -> list[str]:
    """The weight files of a Hugging Face folder, in the index's order (safetensors first).

    Raises:
        FileNotFoundError: the folder holds no weight file weir reads.
    """
    for index_name, single_name in ((SAFETENSORS_INDEX, SAFETENSORS_FILE), (PT_INDEX, PT_FILE)):
        index_path = os.path.join(folder, index_name)
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as f:
                shards = dict.fromkeys(json.load(f)["weight_map"].values())  # ordered, each once
            return [os.path.join(folder, shard) for shard in shards]
        if os.path.exists(os.path.join(folder, single_name)):
            return [os.path.join(folder, single_name)]
    raise FileNotFoundError(f"{folder} has no weights: neither {SAFETENSORS_FILE} nor {PT_FILE} "
                            f"(single, or sharded with {SAFETENSORS_INDEX} / {PT_INDEX})")


def _iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of one safetensors file, memory-mapped.

    Raises:
        ValueError: the file is corrupt or truncated, naming it (safetensors' own error names none).
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def _iter_pt(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    for name in list(state_dict):
        yield name, state_dict.pop(name)  # not kept here once the caller has copied it


def _iter_gguf(src: ModelSource, config) -> Iterator[tuple[str, torch.Tensor]]:
    import numpy as np
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    general, tensors = read_tensors(src.location)
    architecture = general.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; weir loads {GGUF_ARCHITECTURES}")
    if config is None:
        from transformers import AutoConfig

        with shared_gguf_parse():
            config = AutoConfig.from_pretrained(src.path, **src.hf_kwargs())
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    hf_names = gguf_to_hf_names(config, processor)
    for tensor in tensors:
        processed = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                      tensor_key_mapping=hf_names, parsed_parameters={})
        name = hf_names.get(processed.name)
        if name is None:  # as transformers: a tensor its model has no parameter for is skipped
            continue
        # writable and fp32: a tensor stored as F32 is a read-only view of the memory-mapped file
        yield name, torch.from_numpy(np.require(processed.weights, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


_NAME_TABLE_LOCK = threading.Lock()


def gguf_to_hf_names(config, processor: Optional[object] = None) -> dict[str, str]:
    """transformers' map from GGUF tensor names (``blk.0.attn_q.weight``) to its own
    (``model.layers.0.self_attn.q_proj.weight``) for ``config``'s architecture, computed on a model
    built on the ``meta`` device (no weights allocated), and kept by
    :func:`weir.gguf_metadata.cached_json` under the config, the processor's class and the
    libraries' versions: the next load neither imports the family's modeling module nor builds
    the model (about 1.5 s for SmolLM2 on a 2-core CPU)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    processor = processor or TensorProcessor()
    settings = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    key = ("gguf_to_hf_names", type(processor).__name__, json.dumps(settings, sort_keys=True, default=str))
    return cached_json(key, lambda: _gguf_to_hf_names(config, processor))


def _gguf_to_hf_names(config, processor) -> dict[str, str]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    with memoised_gguf_name_table():
        return get_gguf_hf_weights_map(meta_model, processor)


@contextlib.contextmanager
def memoised_gguf_name_table() -> Iterator[None]:
    """While inside, ``gguf.get_tensor_name_map`` is memoised. transformers' GGUF name mapping
    (``get_gguf_hf_weights_map``, also inside ``from_pretrained(gguf_file=...)``) walks every
    submodule and builds gguf's name table again for each (about 400 times, 15 ms each, for a
    30-layer model); the table depends only on its arguments (architecture, number of layers).
    One caller at a time (a lock), restored on leaving."""
    import gguf

    with _NAME_TABLE_LOCK:
        build_table = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build_table)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = build_table
