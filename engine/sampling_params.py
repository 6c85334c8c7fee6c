"""Sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Log-probability reported for a token the sampling filters removed, or any value that is not a
# finite float: JSON has no -inf or NaN (the OpenAI-compatible servers use the same number).
LOGPROB_SENTINEL = -9999.0


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a language (vLLM's ``StructuredOutputsParams``): exactly one
    of ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object`` is set. Compiled and enforced
    by xgrammar (``weir.engine.structured_outputs``): at each step, tokens the grammar cannot take
    next are masked before sampling, and the grammar's end admits only the end-of-sequence token.

    Attributes:
        json: a JSON Schema (a dict, or its text); the output is one JSON value valid against it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF as llama.cpp and xgrammar read it; the start rule is ``root``).
        json_object: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).
        disable_any_whitespace: JSON without free whitespace between tokens (``", "`` and ``": "``
            separators), which keeps a small model from spending its tokens on blank space.

    Raises:
        ValueError: none or more than one constraint set, or one of the wrong type; the message names
            the field (``structured_outputs.<field>``). A schema, regex or grammar the backend cannot
            compile is refused by ``weir.engine.structured_outputs.check``, not here.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"structured_outputs.{name} must be {rule}, got {getattr(self, name)!r}")

        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
                if not isinstance(parsed, (dict, bool)):
                    fail("json", "a JSON Schema (an object)")
            elif not isinstance(self.json, dict):
                fail("json", "a JSON Schema (a dict or its JSON text)")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            fail("regex", "a non-empty string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            fail("grammar", "a non-empty EBNF string")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not (isinstance(self.choice, list) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                fail("choice", "a non-empty list of non-empty strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            fail("json_object", "True, False or None")
        if not isinstance(self.disable_any_whitespace, bool):
            fail("disable_any_whitespace", "True or False")
        chosen = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(chosen) or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint is set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """``(kind, spec text, disable_any_whitespace)``: equal for constraints that compile to the same
        grammar (a schema dict and its JSON text share one key); the compiled-grammar cache's key."""
        spec: Any = getattr(self, self.kind)
        if self.kind == "json":
            spec = json.loads(spec) if isinstance(spec, str) else spec
            spec = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        elif self.kind == "choice":
            spec = json.dumps(spec)
        elif self.kind == "json_object":
            spec = ""
        return self.kind, spec, self.disable_any_whitespace

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutputsParams":
        """From its JSON form (the fields by name), as a job carries it.

        Raises:
            ValueError: ``d`` is not a dict, holds an unknown field, or a field is invalid.
        """
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {d!r}")
        unknown = sorted(set(d) - set(cls.KINDS) - {"disable_any_whitespace"})
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(cls.KINDS)}, disable_any_whitespace")
        return cls(**d)

    def to_dict(self) -> dict:
        """The set fields, JSON-serialisable; ``from_dict`` reads it back."""
        out = {self.kind: getattr(self, self.kind)}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


@dataclass
class SamplingParams:
    """How one request samples its continuation (vLLM's ``SamplingParams``, same defaults).

    Attributes:
        n: number of samples returned for the prompt; they share the prompt's KV blocks.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. ``>= 0``.
        top_p: nucleus sampling mass in ``(0, 1]``; 1 disables it.
        top_k: keep the k most likely tokens; ``0`` or ``-1`` disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's; ``[0, 1]``.
        seed: per-request seed in ``[0, 2**63)``; the same seed gives the same tokens whatever the
            batch holds. Sample ``i`` of ``n`` draws from its own generator derived from it.
        max_tokens: most tokens to generate, ``>= 1``.
        min_tokens: tokens generated before EOS, stop token ids or stop strings may end the
            request (EOS and stop token ids are masked until then). ``0 <= min_tokens <= max_tokens``.
        stop: strings that end generation when they appear in the output text; the text is cut
            before the stop string unless ``include_stop_str_in_output``.
        stop_token_ids: extra token ids that end the request (beside the model's EOS ids).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        ignore_eos: keep generating past EOS (benchmarks).
        presence_penalty: subtracted once from the logit of every token already generated;
            ``[-2, 2]`` (OpenAI's definition).
        frequency_penalty: subtracted from a token's logit once per time it was generated; ``[-2, 2]``.
        repetition_penalty: logits of tokens seen in the prompt or the output are divided by it
            when positive and multiplied by it when negative (Keskar et al. 2019, CTRL); ``> 0``,
            1 disables it.
        logprobs: return the log-probabilities of the top ``logprobs`` tokens at each generated
            position, plus the sampled token's. ``None`` returns none. Values are the model's raw
            log-softmax (before temperature and penalties); non-finite values are reported as
            :data:`LOGPROB_SENTINEL`.
        prompt_logprobs: the same for every prompt position after the first (the prompt is then
            computed in full, without prefix-cache hits).
        skip_special_tokens: drop special tokens from the output text.
        spaces_between_special_tokens: put spaces around special tokens kept in the text.
        structured_outputs: a :class:`StructuredOutputsParams` (or its dict form) constraining the
            output; ``None`` for free text. An output cut by ``max_tokens`` finishes as ``"length"``
            and may be incomplete; one that completes the grammar finishes as ``"stop"``.

    Raises:
        ValueError: a field is out of range; the message names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def finite(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def integer(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, int) and not isinstance(v, bool)

        need(integer("n") and self.n >= 1, "n", "an integer >= 1")
        need(finite("temperature") and self.temperature >= 0, "temperature", "a finite number >= 0")
        need(finite("top_p") and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(integer("top_k") and self.top_k >= -1, "top_k", "-1, 0 (disabled) or >= 1")
        need(finite("min_p") and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(self.seed is None or (integer("seed") and 0 <= self.seed < 2**63), "seed", "None or in [0, 2**63)")
        need(integer("max_tokens") and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        need(integer("min_tokens") and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"an integer in [0, max_tokens={self.max_tokens}]")
        need(finite("presence_penalty") and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        need(finite("frequency_penalty") and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        need(finite("repetition_penalty") and self.repetition_penalty > 0, "repetition_penalty",
             "a finite number > 0")
        need(self.logprobs is None or (integer("logprobs") and self.logprobs >= 0), "logprobs", "None or >= 0")
        need(self.prompt_logprobs is None or (integer("prompt_logprobs") and self.prompt_logprobs >= 0),
             "prompt_logprobs", "None or >= 0")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            need(isinstance(getattr(self, name), bool), name, "True or False")
        need(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
             "None, a string or a list of strings")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        need(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
             "a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        need(all(integer_value(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "non-negative integers")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "None or a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def sample_seed(self, index: int) -> Optional[int]:
        """Seed of sample ``index`` of ``n``: the request seed for sample 0, a hash of
        (seed, index) for the others, so samples differ and reruns repeat them."""
        if self.seed is None or index == 0:
            return self.seed
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1


def integer_value(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
