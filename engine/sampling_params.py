"""Sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional, Union

# Log-probability reported for a token the sampling filters removed, or any value that is not a
# finite float: JSON has no -inf or NaN (the OpenAI-compatible servers use the same number).
LOGPROB_SENTINEL = -9999.0


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
