"""Incremental detokenization: a request's generated token ids become text as they arrive.

Text is decoded from the generated ids alone, never with the prompt in front, so the final text is the
same string as ``tokenizer.decode(output_ids, skip_special_tokens=...)`` (with the prompt as context, a
SentencePiece tokenizer would keep the first token's leading space where a full decode drops it).

Two decoders turn ids into text chunks, both the same algorithm: decode a short window of recent ids,
emit what the newest ids add to the window's text, and hold the ids back while that text ends in
U+FFFD (a multi-byte character split across tokens, not complete yet):

- tokenizers' ``decoders.DecodeStream`` (Rust), used when the tokenizer has a ``backend_tokenizer``;
- ``_WindowDecoder``, the prefix_offset/read_offset method of vLLM's ``detokenize_incrementally``, for
  tokenizers without one, and as a fallback if ``DecodeStream`` rejects a window.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Ids of already emitted text kept as context when the fallback decoder takes over mid-stream
# (vLLM starts its window 5 tokens back for the same reason).
NUM_CONTEXT_IDS = 5


class _WindowDecoder:
    """vLLM's prefix_offset/read_offset incremental detokenization over any ``decode(ids) -> str``.

    ``_ids`` is the window: its first ``_read`` ids are already emitted and decode to ``_prefix``;
    the rest are pending. Emitted ids leave the window one step later, so it stays a few ids long.
    """

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int] = ()):
        self._decode = decode
        self._ids = list(context_ids)
        self._read = len(self._ids)
        self._prefix = decode(self._ids) if self._ids else ""

    def step(self, new_ids: Sequence[int]) -> Optional[str]:
        """Append ids; return the text they complete, or None while it is empty or ends in U+FFFD."""
        self._ids.extend(new_ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix) or text.endswith(REPLACEMENT_CHAR):
            return None
        chunk = text[len(self._prefix):]
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix = self._decode(self._ids)
        return chunk


class _LibraryDecoder:
    """tokenizers' ``DecodeStream`` bound to its ``tokenizers.Tokenizer``, with ``_WindowDecoder``'s step."""

    def __init__(self, backend, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, new_ids: Sequence[int]) -> Optional[str]:
        return self._stream.step(self._backend, list(new_ids))


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text as they arrive, and finds stop strings.

    Owns the generated ids (``token_ids``) and their text, split in three:
    released text (``output_text``, immutable once released), held text (the longest end of the
    decoded text that is a proper prefix of a stop string, at most ``max(len(stop)) - 1`` chars) and
    pending ids inside the decoder (an incomplete UTF-8 sequence). Held and pending text are shown only
    by ``finish()``. After a stop string matched, or after ``finish()``, the text is final.

    Cost per ``update``: one decode of a window of a few ids plus a stop-string search over the new
    text and the held text; the whole output is decoded once, by ``finish()``.

    Args:
        tokenizer: a transformers tokenizer (``decode`` and, for the fast path, ``backend_tokenizer``).
        prompt_token_ids: the request's prompt. Not used as decoding context, so that the text equals a
            full decode of the generated ids and never contains prompt text; kept for vLLM's signature.
        skip_special_tokens: drop special tokens (``<|im_end|>``) from the text.
        spaces_between_special_tokens: passed to ``tokenizer.decode``; only slow tokenizers use it.
        stop: strings that end generation; empty strings are ignored.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: Optional[list[str]] = None,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._stop_prefixes = frozenset(s[:i] for s in self.stop for i in range(1, len(s)))
        self._max_held_chars = max((len(s) for s in self.stop), default=1) - 1

        self._token_ids: list[int] = []
        self._num_decoded_ids = 0  # ids whose text the decoder has emitted
        self._released: list[str] = []
        self._held = ""
        self._num_sent_pieces = 0  # pieces of _released already returned as deltas
        self._text = ""  # "".join(_released[:_num_joined_pieces])
        self._num_joined_pieces = 0
        self._finished = False

        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decoder = (_LibraryDecoder(backend, skip_special_tokens) if backend is not None
                         else _WindowDecoder(self._decode))

    @property
    def token_ids(self) -> list[int]:
        """Every generated id given to ``update``, including those after a stop string."""
        return self._token_ids

    @property
    def output_text(self) -> str:
        """Text safe to show: excludes held stop-string prefixes and incomplete characters."""
        if self._num_joined_pieces < len(self._released):
            self._text += "".join(self._released[self._num_joined_pieces:])
            self._num_joined_pieces = len(self._released)
        return self._text

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> Optional[str]:
        """Append generated ids and decode them.

        With ``check_stop`` False (before a request's ``min_tokens``) the new text is released
        without a stop-string search; it is never searched later.

        Returns:
            The stop string that matched (the text is then cut before it, or after it with
            ``include_stop_str_in_output``), or None. When several match, the one that ends first in
            the text wins, then the longer one; this does not depend on how ids are grouped into calls.

        Raises:
            RuntimeError: the text is already final (a stop string matched, or ``finish()`` ran).
        """
        if self._finished:
            raise RuntimeError("update() after the detokenizer finished")
        if not new_token_ids:
            return None
        self._token_ids.extend(new_token_ids)
        try:
            chunk = self._decoder.step(new_token_ids)
        except Exception:  # DecodeStream refuses windows whose text is not an extension of the last
            start = self._num_decoded_ids
            self._decoder = _WindowDecoder(
                self._decode, self._token_ids[max(0, start - NUM_CONTEXT_IDS):start])
            chunk = self._decoder.step(self._token_ids[start:])
        if chunk is None:
            return None
        self._num_decoded_ids = len(self._token_ids)
        if not check_stop:
            self._release(self._held + chunk)
            self._held = ""
            return None
        return self._add_text(chunk)

    def finish(self) -> None:
        """End generation for a reason other than a stop string (EOS, max_tokens): release all text.

        The final text is one full ``tokenizer.decode`` of ``token_ids``; it adds the held text and any
        incomplete trailing character (as U+FFFD). If the streamed text is not a prefix of the full
        decode (a tokenizer whose decode cleans up spaces), the full decode wins and deltas already
        returned cannot be taken back. Calling it again, or after a stop string, does nothing.
        """
        if self._finished:
            return
        self._finished = True
        self._held = ""
        full = self._decode(self._token_ids)
        shown = self.output_text
        if full.startswith(shown):
            if len(full) > len(shown):
                self._released.append(full[len(shown):])
            return
        num_sent_chars = len("".join(self._released[: self._num_sent_pieces]))
        self._released = [full[:num_sent_chars], full[num_sent_chars:]]
        self._num_sent_pieces = min(self._num_sent_pieces, 1)
        self._text, self._num_joined_pieces = "", 0

    def get_next_output_text(self, delta: bool) -> str:
        """The whole ``output_text``, or with ``delta`` only the part released since the last delta call."""
        if not delta:
            return self.output_text
        new = "".join(self._released[self._num_sent_pieces:])
        self._num_sent_pieces = len(self._released)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def _add_text(self, chunk: str) -> Optional[str]:
        # A stop string ending in the new chunk starts inside the held text or the chunk: released text
        # has no suffix that begins a stop string, so searching held + chunk finds every match.
        text = self._held + chunk
        match = self._first_stop(text)
        if match is not None:
            start, stop_str = match
            self._release(text[: start + len(stop_str) if self.include_stop_str_in_output else start])
            self._held = ""
            self._finished = True
            return stop_str
        num_held = self._num_chars_to_hold(text)
        self._release(text[: len(text) - num_held])
        self._held = text[len(text) - num_held:]
        return None

    def _first_stop(self, text: str) -> Optional[tuple[int, str]]:
        """(start, stop string) of the match that ends first, longer first on ties; None if none."""
        best = None
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[0]):
                best = ((start + len(s), start), s)
        return None if best is None else (best[0][1], best[1])

    def _num_chars_to_hold(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(self._max_held_chars, len(text)), 0, -1):
            if text[-n:] in self._stop_prefixes:
                return n
        return 0

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)
