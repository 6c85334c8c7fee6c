"""Structured outputs: grammars compiled by xgrammar, one matcher per sequence, token bitmasks
filled for the batch at each step and applied to the logits before sampling (the design of vLLM
V1's xgrammar backend).

xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models") compiles a grammar against the tokenizer's vocabulary into a pushdown
automaton with a per-state cache of the tokens it accepts, so that filling one row of the bitmask
costs microseconds. It is imported only here, and only when a request carries
``structured_outputs``: the engine runs without it otherwise.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Optional

import torch

from weir.engine.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

__all__ = ["check", "choice_grammar", "StructuredOutputManager", "StructuredOutputRequest"]


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency of weir
        raise ValueError("structured_outputs needs the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly ``choices``: ``root ::= "a" | "b"`` with each string quoted as a
    JSON string literal (xgrammar's EBNF reads the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema(spec: StructuredOutputsParams):
    return json.loads(spec.json) if isinstance(spec.json, str) else spec.json


def _grammar(spec: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The tokenizer-free grammar of ``spec``; raises ValueError naming the field when the backend
    cannot read it."""
    xgr = _xgrammar()
    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(_schema(spec)),
                                                any_whitespace=not spec.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
        return xgr.Grammar.builtin_json_grammar()
    except (RuntimeError, ValueError, TypeError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        # xgrammar prefixes its messages with "[time] file.cc:line: "
        reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
        raise ValueError(f"structured_outputs.{kind} is not supported: {reason}") from None


def check(params: SamplingParams | StructuredOutputsParams | None) -> None:
    """Refuse a constraint the backend cannot compile, before anything runs.

    Args:
        params: sampling parameters (or their ``structured_outputs``); ``None`` passes.

    Raises:
        ValueError: the JSON schema, regex, choice or EBNF grammar is invalid or uses what xgrammar
            does not support; the message names the field (``structured_outputs.json`` ...).
    """
    spec = params.structured_outputs if isinstance(params, SamplingParams) else params
    if spec is not None:
        _grammar(spec)
