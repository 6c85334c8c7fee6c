"""Sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    """How one request samples its continuation (vLLM's ``SamplingParams``).

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. ``>= 0``.
        top_p: nucleus sampling mass in ``(0, 1]``; 1 disables it.
        top_k: keep the k most likely tokens; ``0`` or ``-1`` disables it.
        seed: per-request seed; the same seed gives the same tokens whatever the batch holds.
        max_tokens: most tokens to generate, ``>= 1``.
        stop_token_ids: extra token ids that end the request (beside the model's EOS ids).
        ignore_eos: keep generating past EOS (benchmarks).
        skip_special_tokens: drop special tokens from the output text.

    Raises:
        ValueError: a field is out of range; the message names the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
