"""The publishability check of a generated product description.

A description is kept whatever it says, but one that does not end its sentence or loops is
flagged, so a shop never publishes it unread. The check is deterministic and costs no model call.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Optional

from weir.jobs.catalog.marker import enrichment_of

OK = "ok"
EMPTY = "empty"
UNFINISHED = "unfinished"
REPETITIVE = "repetitive"

MAX_NGRAM_REPEATS = 2
"""A word 4-gram seen more than this many times in one description marks it repetitive."""

NGRAM = 4

_SENTENCE_END = re.compile(r"[.!?\u3002\u0964][\"'\u201d\u2019)\]]*$")  # . ! ? 。 । then closing quotes/brackets
ABBREVIATIONS = ("Mr", "Mrs", "Ms", "Dr", "Prof", "St", "No", "Nos", "Rs", "Vol", "vs", "e.g", "i.e", "approx",
                 "incl", "Pvt")
"""Abbreviations whose full stop does not end a sentence (a title, "No. 5", "Rs. 99", "e.g."): text
ending with one, or with initials ("S.C.", "S.S."), was cut by a ". " stop string inside its
sentence. Case-sensitive ("say no." ends). A sentence that really ends with initials ("the U.S.")
is flagged too: it is rare in a product description, and a flag only asks for a reading."""
_ABBREVIATION_END = re.compile(r"(?:^|[^\w.])(?:(?:" + "|".join(re.escape(a) for a in ABBREVIATIONS)
                               + r")\.|(?:\w\.){2,})$")
_WORD = re.compile(r"\w+", re.UNICODE)


def repeated_ngram(text: str, n: int = NGRAM) -> Optional[tuple[str, int]]:
    """The most repeated word n-gram of ``text`` (words: ``\\w+`` runs, case-folded) and its count,
    or None when the text has fewer than ``n`` words."""
    words = [w.casefold() for w in _WORD.findall(text)]
    if len(words) < n:
        return None
    counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    gram, count = counts.most_common(1)[0]
    return " ".join(gram), count


def description_quality(text: Optional[str]) -> str:
    """Judge one generated description by its text alone (stop strings already cut).

    Returns:
        ``"ok"``; ``"empty"`` for blank text; otherwise the flags that apply, in this order and
        joined by commas: ``"unfinished"`` (some line does not end with a sentence end ``. ! ?``
        (or ``\u3002``, ``\u0964``), optionally followed by closing quotes or brackets: text cut
        by ``max_tokens`` mid-sentence ends this way, and so does a heading line, such as the
        product's title, before the sentence; or the text ends with one of
        :data:`ABBREVIATIONS` or with initials, cut inside its sentence) and
        ``"repetitive"`` (some word 4-gram occurs three times or more).
    """
    text = (text or "").strip()
    if not text:
        return EMPTY
    flags = []
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not all(_SENTENCE_END.search(line) for line in lines) or _ABBREVIATION_END.search(text):
        flags.append(UNFINISHED)
    top = repeated_ngram(text)
    if top is not None and top[1] > MAX_NGRAM_REPEATS:
        flags.append(REPETITIVE)
    return ",".join(flags) or OK


def pick_description(texts: list[Optional[str]]) -> int:
    """Which of several attempts at one description to keep: the first whose quality is ``ok``,
    else the first (a flagged description is kept flagged, never dropped)."""
    return next((i for i, text in enumerate(texts) if description_quality(text) == OK), 0)


class DescriptionRetry:
    """The catalog's post-run policy (:class:`weir.jobs.applications.PostRunPolicy`): a generation
    that asks for a retry (its :class:`~weir.jobs.catalog.marker.Enrichment`'s ``retry_sampling``)
    and whose text the check flags runs once more with that sampling; the first clean attempt is
    kept (:func:`pick_description`)."""

    def retry_params(self, request: Any, output: Any) -> Optional[Any]:
        enrichment = enrichment_of(request)
        if enrichment is None or not enrichment.retry_sampling or description_quality(output.outputs[0].text) == OK:
            return None
        return request.params_with(enrichment.retry_sampling)

    def pick(self, request: Any, outputs: list[Any]) -> int:
        return pick_description([output.outputs[0].text for output in outputs])


DESCRIPTION_RETRY = DescriptionRetry()
"""The instance the ``weir.post_run_policies`` entry point names."""

