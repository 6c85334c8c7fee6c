"""What may be published unread: a decision per enriched field, with its reasons.

Each field of a product's enrichment gets ``auto`` (publish it), ``review`` (a person reads it
first) or ``reject`` (do not use it), and the reasons as a list of ``{"code", "text"}`` objects
(``"field"`` too for an attribute), stored beside the field in ``product_enrichment``
(``<field>_decision``, ``<field>_reasons``). Deterministic, no model call:

- category: ``reject`` without a label (``no_label``); ``review`` when its probability (stored as
  ``category_confidence``) is below the spec's ``[classify] review_below`` (``low_confidence``,
  with the probability); else ``auto``.
- description: ``reject`` when :func:`weir.jobs.catalog.quality.description_quality` flags it
  (codes ``empty``, ``unfinished``, ``repetitive`` with the repeated words); else ``review`` when
  it states something its listing does not support
  (:func:`weir.jobs.catalog.grounding.unsupported_claims`), names neither the product's title nor
  its brand (``not_about_product``), uses more than :data:`MAX_UNLISTED_WORDS` content words its
  listing does not hold (``unlisted_words``, the first five shown), or there is no listing to check it against
  (``no_listing``); else ``auto``.
- attributes: ``reject`` when the extraction was cut by ``max_tokens`` (``cut_by_max_tokens``) or
  gave no object (``no_value``); else ``review`` when a value is the worked example's for that
  field and the listing does not hold it (``example_value``), or the listing does not hold it
  (``unsupported_value``), or it is not what its field's evidence kind (the spec's
  ``[extract.evidence]``, :data:`EVIDENCE_KINDS`) accepts, or there is no listing
  (``no_listing``); else ``auto``. A value stays
  stored as the model gave it; a null (the model abstaining) is never a reason. Beside it,
  :func:`attribute_confidence` stores each value's probability from the sampled tokens'
  log-probabilities (the extraction asks the engine for them, ``logprobs = 0``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from weir.jobs.catalog.grounding import (AUDIENCES, COLOUR_VALUES, CONNECTIVES, MATERIALS, Evidence, Listing,
                                        names_the_product, quantities, reason, unlisted_words, unsupported_claims,
                                        words)
from weir.jobs.catalog.quality import EMPTY, OK, REPETITIVE, description_quality, repeated_ngram

EVIDENCE_KINDS = {
    "listing": "the listing holds the value (its words together, case and plural aside; a number among its numbers)",
    "brand": "the listing's own brand, where it has one, agrees (one holds the other's words): else "
             "``differs_from_listing``; without one, as ``listing``",
    "colour": "every word is a colour (:data:`weir.jobs.catalog.grounding.COLOUR_VALUES`), else "
              "``outside_vocabulary``, and the listing holds each",
    "material": "every word is a material (:data:`weir.jobs.catalog.grounding.MATERIALS`), else "
                "``outside_vocabulary``, and the listing holds each, and names no other material, else "
                "``several_in_listing``",
    "audience": "every word names people (:data:`weir.jobs.catalog.grounding.AUDIENCES`), else "
                "``outside_vocabulary``, and the listing holds each",
    "count": "the listing states the number as a count (\"pack of 2\", \"set of 6\", \"3 pcs\"), else "
             "``unsupported_count``",
    "none": "nothing in a listing shows the value right (a model code, a free-form type): always "
            "``review`` (``unverifiable``)",
}
"""What shows an extracted value right, per evidence kind (the spec's ``[extract.evidence]``)."""

VOCABULARIES = {"colour": COLOUR_VALUES, "material": MATERIALS, "audience": AUDIENCES}

_COUNT = r"(?:pack|set|combo|box|pair|bundle)\s+of\s+{n}\b|\b{n}\s*-?\s*(?:pcs|pc|pieces?|packs?|pairs?|units?|count)\b"

MAX_UNLISTED_WORDS = 0
"""A description using more content words its listing does not hold than this
(:func:`weir.jobs.catalog.grounding.unlisted_words`) is ``review`` (``unlisted_words``): the
free-form inventions no word list names ("made entirely from pure onion seeds"). First chosen on
the tuning descriptions (``tests/data/grounding/tuning``) as 1: none of their 15 ``auto`` ones held
an unsupported claim (at 2, 2 of 20 did). On the wide part (``tests/data/grounding/wide``, 1,625
descriptions) 1 let 6 unsupported descriptions of 52 ``auto`` through (88.5 %), 0 lets 1 of 23
(95.7 %), so 0 it is. On the fresh part (``tests/data/grounding/fresh``, 1,140 descriptions
drawn after the choice) 15 are ``auto``, 1 of them unsupported (93.3 %)."""

MAX_SHOWN_WORDS = 5

AUTO = "auto"
REVIEW = "review"
REJECT = "reject"


@dataclass(frozen=True)
class Decision:
    """One field's decision and its reasons (empty for ``auto``)."""

    field: str
    decision: str
    reasons: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"field": self.field, "decision": self.decision, "reasons": self.reasons}


def judge_category(label: Optional[str], probability: Optional[float] = None,
                   review_below: Optional[float] = None) -> Decision:
    """A classification's decision: ``reject`` (``no_label``) without a label; ``review``
    (``low_confidence``) when ``probability`` (the label's, 0 to 1) is below ``review_below``;
    else ``auto``."""
    if not label:
        return Decision("category", REJECT, [reason("no_label")])
    if review_below and probability is not None and probability < review_below:
        return Decision("category", REVIEW, [reason("low_confidence", f"{probability:.2f}")])
    return Decision("category", AUTO)


def judge_description(text: Optional[str], listing: Optional[Listing]) -> Decision:
    """A description's decision (see the module's docstring)."""
    quality = description_quality(text)
    if quality != OK:
        reasons = []
        for flag in quality.split(","):
            if flag == REPETITIVE:
                top = repeated_ngram(text or "")
                reasons.append(reason(flag, top[0] if top else None))
            else:
                reasons.append(reason(flag) if flag == EMPTY else reason(flag, _ending(text or "")))
        return Decision("description", REJECT, reasons)
    if listing is None:
        return Decision("description", REVIEW, [reason("no_listing")])
    claims = unsupported_claims(text or "", listing)
    if not names_the_product(text or "", listing):
        claims.append(reason("not_about_product"))
    flagged = {w for claim in claims for w in words(claim.get("text", ""))}
    unlisted = [w for w in unlisted_words(text or "", listing) if w not in flagged]
    if len(unlisted) > MAX_UNLISTED_WORDS:
        claims.append(reason("unlisted_words", ", ".join(unlisted[:MAX_SHOWN_WORDS])))
    return Decision("description", REVIEW if claims else AUTO, claims)


def _ending(text: str, num_chars: int = 40) -> str:
    """The last ``num_chars`` characters of ``text`` at most, from a word's start: where to look."""
    text = text.strip()
    tail = text[-num_chars:]
    return tail if len(text) <= num_chars or text[-num_chars - 1].isspace() else tail.split(" ", 1)[-1]


def _shown(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _holds(evidence: Evidence, value: Any) -> bool:
    """Whether the listing holds an extracted value: a number among its numbers, a string whose
    words it holds together (case, plural), a boolean always (nothing to copy)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return float(value) in evidence.values
    if isinstance(value, str):
        return evidence.supports_phrase(value) or any(
            q.base is not None and (q.dimension, q.base) in evidence.measures for q in quantities(value))
    if isinstance(value, list):
        return all(_holds(evidence, v) for v in value)
    return False


def _value_reason(kind: str, evidence: Evidence, listing: Listing, value: Any) -> Optional[str]:
    """None when ``value`` passes its field's evidence kind (:data:`EVIDENCE_KINDS`), else the code."""
    if kind == "none":
        return "unverifiable"
    if kind == "brand" and listing.brand.strip() and isinstance(value, str):
        own, said = " ".join(words(listing.brand)), " ".join(words(value))
        agree = bool(own and said) and (f" {said} " in f" {own} " or f" {own} " in f" {said} ")
        return None if agree else "differs_from_listing"
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            return "unsupported_count"
        pattern = _COUNT.format(n=int(value))
        return None if re.search(pattern, listing.text, re.IGNORECASE) else "unsupported_count"
    if kind in VOCABULARIES and isinstance(value, str):
        said = [w for w in words(value) if w not in CONNECTIVES]
        if not said or any(w not in VOCABULARIES[kind] for w in said):
            return "outside_vocabulary"
        if not all(w in evidence.words for w in said):
            return "unsupported_value"
        if kind == "material" and (evidence.words & MATERIALS) - set(said):
            return "several_in_listing"  # "steel" where the listing also says "aluminium": which is it made of?
        return None
    return None if _holds(evidence, value) else "unsupported_value"


def judge_attributes(parsed: Any, finish_reason: Optional[str], listing: Optional[Listing],
                     example_values: Optional[dict[str, list[Any]]] = None,
                     field_evidence: Optional[dict[str, str]] = None) -> Decision:
    """An extraction's decision (see the module's docstring).

    Args:
        parsed: the extraction's parsed object (None when it did not finish).
        finish_reason: its job's (``length``: cut by ``max_tokens``).
        listing: the product's listing; None when the job carried none.
        example_values: field -> the values the prompt's worked examples give it.
        field_evidence: field -> its evidence kind (:data:`EVIDENCE_KINDS`; not named: ``listing``).
    """
    if finish_reason == "length":
        return Decision("attributes", REJECT, [reason("cut_by_max_tokens")])
    if not isinstance(parsed, dict):
        return Decision("attributes", REJECT, [reason("no_value")])
    if listing is None:
        return Decision("attributes", REVIEW, [reason("no_listing")])
    evidence = Evidence.of(listing)
    examples = example_values or {}
    reasons = []
    kinds = field_evidence or {}
    for name, value in parsed.items():
        if value is None:
            continue
        code = _value_reason(kinds.get(name, "listing"), evidence, listing, value)
        if code is None:
            continue
        if code == "unsupported_value" and any(value == example for example in examples.get(name, [])):
            code = "example_value"
        reasons.append(reason(code, _shown(value), field=name))
    return Decision("attributes", REVIEW if reasons else AUTO, reasons)


def judge(mark: Any, *, is_classification: bool, label: Optional[str] = None, output_text: Optional[str] = None,
          parsed: Any = None, finish_reason: Optional[str] = None,
          label_probs: Optional[dict[str, float]] = None) -> Decision:
    """The decision on the field a succeeded enrichment job fills, from its mark
    (:class:`weir.jobs.catalog.marker.Enrichment`) and its result: the one the stored row gets and
    the one ``weir enrich`` and ``weir results`` report."""
    if is_classification:
        return judge_category(label, (label_probs or {}).get(label), mark.review_below)
    if mark.field == "attributes":
        return judge_attributes(parsed, finish_reason, mark.listing, mark.example_values, mark.field_evidence)
    return judge_description(output_text, mark.listing)


def annotate_result(row: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The catalog's annotation of a result row (the ``weir.result_annotations`` entry point
    ``enrichment``): the decision on the field a succeeded enrichment job fills, as
    :meth:`Decision.as_dict` gives it; None for any other row."""
    from weir.jobs.catalog.marker import enrichment_of

    mark = enrichment_of(row)
    if mark is None or row.get("status") != "succeeded":
        return None
    return judge(mark, is_classification=row.get("kind") == "classify", label=row.get("label"),
                 output_text=row.get("output_text"), parsed=row.get("parsed"),
                 finish_reason=row.get("finish_reason"), label_probs=row.get("label_probs")).as_dict()


def attribute_confidence(parsed: Any, completions: Optional[list[dict[str, Any]]]) -> Optional[dict[str, float]]:
    """Field -> the probability the model gave the tokens of its value (``exp`` of their summed
    log-probabilities, 0 to 1, rounded to 4 places), for each non-null value of ``parsed``.

    The engine reports log-probabilities after the grammar's mask (as vLLM does), so for an enum
    field it is the chosen option's probability against the others the schema allows; for free
    text, that of the whole value. A token that spans the value's edge (``":"g`` ...) counts.

    Args:
        parsed: the extraction's object.
        completions: its job's stored completions; the first one's ``logprobs`` (per token, the
            sampled one first with its ``decoded_token``) are read.

    Returns:
        None when there is no object or the job asked for no log-probabilities; a field whose
        value cannot be found in the decoded tokens is left out.
    """
    if not isinstance(parsed, dict) or not completions or not completions[0].get("logprobs"):
        return None
    spans, text = [], ""
    for position in completions[0]["logprobs"]:
        piece = position[0].get("decoded_token") or ""
        spans.append((len(text), len(text) + len(piece), position[0]["logprob"]))
        text += piece
    decoder = json.JSONDecoder()
    found: dict[str, float] = {}
    at = 0
    for name, value in parsed.items():
        key = text.find(json.dumps(name, ensure_ascii=False) + ":", at)
        if key < 0:
            continue
        start = key + len(json.dumps(name, ensure_ascii=False)) + 1
        while start < len(text) and text[start].isspace():
            start += 1
        try:
            _, end = decoder.raw_decode(text, start)
        except ValueError:
            continue
        at = end
        if value is None:
            continue
        total = sum(logprob for first, last, logprob in spans if first < end and last > start)
        found[name] = round(math.exp(total), 4)
    return found

