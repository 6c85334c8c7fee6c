"""Prompts and labels to token ids, checked against the engine's limits, outside the step loop.

vLLM V1's ``Processor``: the front end tokenizes and validates, so the process that steps the model
spends no time on it, and a bad prompt fails in the caller before anything is queued.
"""

from __future__ import annotations

from typing import Optional

from weir.model_source import NO_TOKENIZER, PromptType, encode_prompt, encode_prompts


class InputProcessor:
    """Tokenizes and checks requests for one engine.

    Args:
        tokenizer: the model's transformers tokenizer, or None (token-id prompts only).
        max_model_len: the engine's context length in tokens.
        vocab_size: the model's vocabulary size (valid token ids are ``[0, vocab_size)``).
        scheduling_policy: the engine's ``"fcfs"`` or ``"priority"``.
        structured_outputs: the engine's ``StructuredOutputManager`` when it lives in this process
            (constraints are then compiled here, into the engine's cache); None: they are only
            checked here and compiled by the engine core.

    Thread safety: tokenizers are not guaranteed thread-safe; callers that share one processor
    across threads serialize the ``encode_*`` calls (``EngineFront`` does).
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, scheduling_policy: str,
                 structured_outputs=None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.scheduling_policy = scheduling_policy
        self.structured_outputs = structured_outputs

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for an empty prompt, one that cannot fit ``max_model_len`` or one with
        token ids outside the vocabulary."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len} allows "
                             f"(at least one token must be generated)")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def check_priority(self, priority: int) -> None:
        """Raise ValueError for a priority that is not an integer, or not 0 under ``"fcfs"``
        (vLLM refuses it the same way)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (the engine's is "
                             f"{self.scheduling_policy!r})")

    def check_structured_outputs(self, params) -> None:
        """Refuse ``params.structured_outputs`` that cannot be compiled, in the caller's thread.
        With the engine in this process the grammar is compiled into its cache, so the step loop
        finds it there.

        Raises:
            ValueError: the constraint is invalid or unsupported (the message names the field).
        """
        spec = params.structured_outputs
        if spec is None:
            return
        if self.structured_outputs is not None:
            self.structured_outputs.compile(spec)
        else:
            from weir.engine.structured_outputs import check

            check(spec)

    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """Token ids of a prompt (:func:`weir.model_source.encode_prompt`), checked by :meth:`check_prompt`.

        Raises:
            ValueError: the prompt is malformed, empty or longer than ``max_model_len`` allows.
        """
        ids = encode_prompt(self.tokenizer, prompt)
        self.check_prompt(ids)
        return ids

    def encode_prompts(self, prompts: list[PromptType]) -> list[list[int]]:
        """Token ids of many prompts in one tokenizer call (:func:`weir.model_source.encode_prompts`),
        not checked: each is checked when it is submitted.

        Raises:
            ValueError: a prompt is malformed or empty.
        """
        return encode_prompts(self.tokenizer, prompts)

    def encode_label(self, label: str, append_eos: bool = True) -> list[int]:
        """Token ids of a label as an answer: its tokens, then the tokenizer's EOS (so that a
        label that is a prefix of another is scored as a complete answer)."""
        tok = self._require_tokenizer()
        ids = tok(label, add_special_tokens=False).input_ids
        if append_eos and tok.eos_token_id is not None:
            ids = ids + [tok.eos_token_id]
        return ids

    def encode_labels(self, labels: list[str], label_texts: Optional[list[str]] = None) -> list[list[int]]:
        """Token ids scored for each label: ``label_texts[i]`` exactly as given when set (no EOS
        added), else the label followed by EOS (:meth:`encode_label`).

        Raises:
            TypeError: ``labels`` or ``label_texts`` is not a list of strings (a string ``"AB"``
                would otherwise be read as the labels ``"A"``, ``"B"``).
            ValueError: empty label list, or ``label_texts`` of another length.
        """
        for name, texts in (("labels", labels), ("label_texts", label_texts)):
            if texts is not None and (not isinstance(texts, (list, tuple))
                                      or not all(isinstance(t, str) for t in texts)):
                raise TypeError(f"{name} must be a list of strings, got {type(texts).__name__} {texts!r}")
        if not labels:
            raise ValueError("labels is empty")
        if label_texts is None:
            return [self.encode_label(lab) for lab in labels]
        if len(label_texts) != len(labels):
            raise ValueError(f"label_texts has {len(label_texts)} entries for {len(labels)} labels")
        tok = self._require_tokenizer()
        return [tok(t, add_special_tokens=False).input_ids for t in label_texts]

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        return self.tokenizer
