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
from collections import OrderedDict
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


# JSON Schema keywords xgrammar enforces; ``format`` and the other annotations are accepted and not
# enforced (an annotation by JSON Schema's default). Any other keyword (``not``, ``allOf``,
# ``if``/``then``, ``patternProperties``, ``uniqueItems``, ...) would be ignored by the grammar, so
# outputs could violate the schema: it is refused instead.
SUPPORTED_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern",
    "title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly",
})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")


def unsupported_schema_keyword(schema, path: str = "#") -> Optional[str]:
    """The first keyword of ``schema`` (walked through its subschemas) that the grammar would not
    enforce, as ``"'not' at #/properties/a"``, or None. A ``$ref`` must point inside the schema."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key not in SUPPORTED_KEYWORDS:
            return f"{key!r} at {path}"
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            return f"'$ref' to {value!r} at {path} (only '#...' references inside the schema)"
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            found = unsupported_schema_keyword(sub, f"{path}/{key}/{name}")
            if found:
                return found
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            found = unsupported_schema_keyword(sub, f"{path}/{key}/{i}")
            if found:
                return found
    for key in _SUBSCHEMAS:
        found = unsupported_schema_keyword(schema.get(key), f"{path}/{key}")
        if found:
            return found
    return None


def inner_anchor(regex: str) -> Optional[str]:
    """A ``^`` or ``$`` anchor of ``regex`` that is not at its very start or end (outside
    character classes and escapes), as ``"'^' at position 1"``, or None. The whole output is
    matched against the pattern, so an inner anchor could only make it unmatchable; the backend
    would drop it silently and accept outputs the pattern refuses (``a^b`` would admit ``ab``)."""
    i, in_class, class_start = 0, False, -1
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]" or i == class_start  # a "]" first in the class is literal
        elif c == "[":
            in_class = True
            class_start = i + 2 if regex[i + 1:i + 2] == "^" else i + 1
            i = class_start
            continue
        elif (c == "^" and i != 0) or (c == "$" and i != len(regex) - 1):
            return f"{c!r} at position {i}"
        i += 1
    return None


def _grammar(spec: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The tokenizer-free grammar of ``spec``; raises ValueError naming the field when the backend
    cannot read it."""
    xgr = _xgrammar()
    kind = spec.kind
    if kind == "json":
        found = unsupported_schema_keyword(_schema(spec))
        if found:
            raise ValueError(f"structured_outputs.json is not supported: {found} would not be enforced "
                             "(weir.engine.structured_outputs.SUPPORTED_KEYWORDS lists what is)")
    if kind == "regex":
        found = inner_anchor(spec.regex)
        if found:
            raise ValueError(f"structured_outputs.regex is not supported: anchor {found}; the whole "
                             "output is matched, so '^' and '$' are allowed only at the pattern's ends")
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
        # any JSON object (OpenAI's json_object), as vLLM compiles it
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        # xgrammar prefixes its messages with "[time] file.cc:line: "
        reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
        raise ValueError(f"structured_outputs.{kind} is not supported: {reason}") from None


MAX_CHECKED_CONSTRAINTS = 256
_checked_keys: OrderedDict[tuple, None] = OrderedDict()
_checked_lock = threading.Lock()


def check(params: SamplingParams | StructuredOutputsParams | None) -> None:
    """Refuse a constraint the backend cannot compile, before anything runs: the one check, used by
    the engine's input processor, the job schemas and the catalog's spec loader.

    A constraint that passed is remembered by :attr:`StructuredOutputsParams.key` (the
    ``MAX_CHECKED_CONSTRAINTS`` most recent), so a batch that repeats one schema builds its grammar
    once. Compiled grammars (bound to a tokenizer) are cached by :class:`StructuredOutputManager`.

    Args:
        params: sampling parameters (or their ``structured_outputs``); ``None`` passes.

    Raises:
        ValueError: the JSON schema, regex, choice or EBNF grammar is invalid or uses what xgrammar
            does not support; the message names the field (``structured_outputs.json`` ...).
    """
    spec = params.structured_outputs if isinstance(params, SamplingParams) else params
    if spec is None:
        return
    key = spec.key
    with _checked_lock:
        if key in _checked_keys:
            _checked_keys.move_to_end(key)
            return
    _grammar(spec)
    with _checked_lock:
        _checked_keys[key] = None
        if len(_checked_keys) > MAX_CHECKED_CONSTRAINTS:
            _checked_keys.popitem(last=False)


class StructuredOutputRequest:
    """The grammar state of one sequence: an xgrammar ``GrammarMatcher`` that has accepted every
    output token so far. It follows the sequence through chunked prefill and preemption by
    recompute (those recompute tokens it already accepted and sample nothing in between); each
    sequence of an ``n > 1`` request has its own, started fresh."""

    def __init__(self, matcher: "xgrammar.GrammarMatcher"):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar cannot take it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended: it accepted a stop token after a complete output."""
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and fills the token bitmasks of a step.

    The xgrammar tokenizer info and compiler are built on first use (a model without structured
    requests never imports xgrammar). Compiled grammars are cached by
    :attr:`StructuredOutputsParams.key` for the engine's tokenizer, so thousands of jobs that share
    a schema compile it once; the least recently used is dropped past ``max_cached_grammars``
    (a running sequence keeps its own reference). :meth:`stats` reports compilations, cache hits and
    compile time.

    Args:
        tokenizer: the engine's Hugging Face tokenizer (None: every constrained request is refused).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        eos_token_ids: the tokens that end a complete output (the grammar's stop tokens).
        max_cached_grammars: compiled grammars kept.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], max_cached_grammars: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None
        self._batch_matcher = None
        self._cache: OrderedDict[tuple, "xgrammar.CompiledGrammar"] = OrderedDict()
        self.max_cached_grammars = max_cached_grammars
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_time_s = 0.0
        self.last_compile_time_s: Optional[float] = None

    def _get_compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init is set)")
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            self._batch_matcher = xgr.BatchGrammarMatcher()
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of ``spec`` (from the cache when one with the same key was compiled).

        Raises:
            ValueError: no tokenizer, or a constraint xgrammar cannot compile (naming the field).
        """
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self.num_cache_hits += 1
                self._cache.move_to_end(key)
                return compiled
            compiler = self._get_compiler()
            started = time.perf_counter()
            compiled = compiler.compile_grammar(_grammar(spec))
            elapsed = time.perf_counter() - started
            self._check_not_empty(spec, compiled)
            self._cache[key] = compiled
            if len(self._cache) > self.max_cached_grammars:
                self._cache.popitem(last=False)
            self.num_compiled += 1
            self.compile_time_s += elapsed
            self.last_compile_time_s = elapsed
            return compiled

    def _check_not_empty(self, spec: StructuredOutputsParams, compiled) -> None:
        """Refuse a grammar whose start admits no token at all (``regex="[^\\s\\S]"``): every
        output would be cut at its first token."""
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        if not bool((bitmask != 0).any()):
            raise ValueError(f"structured_outputs.{spec.kind} admits no output (no token can start it)")

    def new_request(self, spec: StructuredOutputsParams) -> StructuredOutputRequest:
        """A fresh matcher at the grammar's start, for one sequence."""
        xgr = _xgrammar()
        return StructuredOutputRequest(xgr.GrammarMatcher(self.compile(spec)))

    def grammar_bitmask(self, states: list[Optional[StructuredOutputRequest]]) -> Optional[torch.Tensor]:
        """The step's token bitmask for the rows being sampled, filled in one batched call.

        Args:
            states: per sampled row, its sequence's grammar state, or None for a free row.

        Returns:
            ``[num_rows, ceil(vocab_size / 32)]`` int32 on the host (bit ``t % 32`` of word
            ``t // 32`` set: token ``t`` allowed; free rows allow every token), or None when no
            row is constrained.
        """
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        xgr = _xgrammar()
        self._get_compiler()
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        self._batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, rows)
        return bitmask

    def stats(self) -> dict:
        return {"num_grammars_compiled": self.num_compiled, "grammar_cache_hits": self.num_cache_hits,
                "grammar_compile_time_s": self.compile_time_s}


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]] = None) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask disallows.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32 on any device.
        bitmask: ``[num_rows, ceil(vocab_size / 32)]`` int32 on the host
            (:meth:`StructuredOutputManager.grammar_bitmask`); copied to the logits' device.
        rows: the constrained rows (the others are left untouched); None: every row.
    """
    xgr = _xgrammar()
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
