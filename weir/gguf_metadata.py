"""transformers' reading of a GGUF file's metadata (config, tokenizer), done once per file.

``AutoConfig`` and ``AutoTokenizer`` each call
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(path, return_tensors=False)``, which
reads every metadata value through ``gguf.GGUFReader`` and turns it into Python values: 18-20 s for
Gemma 3's 262,144-token vocabulary on this repository's 2-core test machine, 5-6 s for SmolLM2's
49,152, every time a worker, an engine or a client loads the model. Inside :func:`shared_gguf_parse`
that function is answered from

1. this process's parses (config and tokenizer share one), then
2. a JSON file in :data:`CACHE_DIR`, written after the first parse of the file, keyed by the file's
   real path, size, modification time, inode and status-change time and by the versions of
   transformers and gguf (a changed or replaced file, or another transformers, parses again); a
   cache file that cannot be read or written is ignored.

Each caller gets its own copy. Only the metadata is cached; tensors are read from the GGUF file
itself (:mod:`weir.gguf_file`). Deleting :data:`CACHE_DIR` is always safe.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from typing import Any, Callable, Iterator, Optional

logger = logging.getLogger(__name__)

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "weir", "gguf-metadata")
"""Where parsed GGUF metadata is kept: one JSON file per GGUF file and library versions."""

FORMAT_VERSION = 1

_LOCK = threading.Lock()
_parses: dict[tuple, Any] = {}  # cache key -> transformers' parse, while a shared_gguf_parse() runs
_key_locks: dict[tuple, threading.Lock] = {}
_num_users = 0


def _cache_key(path: str) -> tuple:
    stat = os.stat(path)
    # the inode and ctime too: a file replaced by one of the same size with its mtime kept (cp -p,
    # rsync -t, tar) has a new inode or ctime, which no user can set back
    return (FORMAT_VERSION, os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns,
            *_library_versions())


def _library_versions() -> tuple:
    """The versions of transformers and gguf, which every cached value depends on."""
    import gguf
    import transformers

    return transformers.__version__, getattr(gguf, "__version__", None) or _distribution_version("gguf")


def _distribution_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cached_json(key: tuple, compute: Callable[[], Any]) -> Any:
    """``compute()``, kept in :data:`CACHE_DIR` as JSON under ``key`` (JSON values; the versions of
    transformers and gguf are added to it) for the next process: for what transformers derives
    from a GGUF file's metadata alone, such as its tensor names. A value JSON would not give back
    equal is returned and not stored; an unreadable or unwritable cache is passed by."""
    return _read_or_compute(("derived", FORMAT_VERSION, *key, *_library_versions()), compute)


def _read_or_compute(key: tuple, compute: Callable[[], Any]) -> Any:
    value = _read_cached(key)
    if value is None:
        value = compute()
        _write_cached(key, value)
    return value


def _cache_file(key: tuple) -> str:
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return os.path.join(CACHE_DIR, f"{digest}.json")


def _read_cached(key: tuple) -> Optional[Any]:
    try:
        with open(_cache_file(key), encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != list(key):
        return None
    return stored.get("parse")


def _write_cached(key: tuple, parsed: Any) -> None:
    """Store ``parsed`` when JSON gives it back unchanged (an atomic rename, so readers never see
    half a file); any failure leaves the cache as it was."""
    tmp = None
    try:
        text = json.dumps({"key": list(key), "parse": parsed})
        if json.loads(text)["parse"] != parsed:  # a tuple, a NaN, a non-string key: not cached
            return
        os.makedirs(CACHE_DIR, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=CACHE_DIR, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, _cache_file(key))
    except (OSError, TypeError, ValueError) as e:
        logger.debug("GGUF metadata not cached: %s", e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _parsed_once(parse, path: str) -> Any:
    key = _cache_key(path)
    with _LOCK:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:  # threads loading the same file wait for one parse
        parsed = _parses.get(key)
        if parsed is None:
            parsed = _parses[key] = _read_or_compute(key, lambda: parse(path, return_tensors=False))
    return copy.deepcopy(parsed)


@contextlib.contextmanager
def shared_gguf_parse(enabled: bool = True) -> Iterator[None]:
    """While inside, transformers' GGUF metadata parse is answered once per file (module docstring).

    Re-entrant and thread-safe: the first to enter installs the shared parse, the last to leave
    restores transformers' function and drops the parses this process holds (the files in
    :data:`CACHE_DIR` stay). Tensor reads (``return_tensors=True``) go to transformers unchanged.

    Args:
        enabled: False makes it do nothing, for a model that is no GGUF file: transformers' GGUF
            module is then not imported (about 0.5 s).
    """
    global _num_users
    if not enabled:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    with _LOCK:
        _num_users += 1
        if _num_users == 1:
            parse = gguf_utils.load_gguf_checkpoint

            @functools.wraps(parse)
            def load_gguf_checkpoint(path, return_tensors=False, *args, **kwargs):
                if return_tensors or args or kwargs:
                    return parse(path, return_tensors, *args, **kwargs)
                return _parsed_once(parse, path)

            load_gguf_checkpoint.transformers_parse = parse
            gguf_utils.load_gguf_checkpoint = load_gguf_checkpoint
    try:
        yield
    finally:
        with _LOCK:
            _num_users -= 1
            if _num_users == 0:
                gguf_utils.load_gguf_checkpoint = gguf_utils.load_gguf_checkpoint.transformers_parse
                _parses.clear()
                _key_locks.clear()
