"""Whether what the model wrote about a product is supported by the product's own listing.

A deterministic check, no model call. The listing (:class:`Listing`: title, brand, the source
description, the catalog's category) is the only evidence; anything a generated text states that the
listing's text does not is reported as a reason, a short snake_case ``code`` with the offending
``text``:

- ``unsupported_number``: a number (with its unit, if any) the listing does not hold;
  ``unsupported_unit``: the number is in the listing, but with another quantity ("5 kg" for "5 g").
  Numbers are compared as values ("1,000" = "1000", "1.50" = "1.5"); a unit is normalised with its
  spelling, plural and spacing ("5kg" = "5 kg" = "5 kilograms") and converted within its
  dimension (1 kg = 1000 g, 1 l = 1000 ml). Numbers written as words are not read.
- ``unsupported_price``: a currency (symbol or word) next to a number, unless the listing shows
  the same currency and number; ``unsupported_currency``: a currency named with no number that the
  listing never names (₹, Rs, rupee and INR are one currency).
- ``unsupported_material``, ``unsupported_colour``: a word of :data:`MATERIALS` or
  :data:`COLOURS` the listing's text does not hold.
- ``unsupported_place``: a word of :data:`PLACES` (countries, nationalities, regions) the listing
  does not hold, wherever it stands.
- ``unsupported_claim``: a word of :data:`CLAIMS` ("proven", "organic", "immunity") the listing
  does not hold.
- ``unsupported_name``: a capitalised word (a brand, a place, a person) inside a sentence, not the
  first word of one, that the listing does not hold and that is not in :data:`COMMON_WORDS`. A
  sentence's first word is not read this way (every sentence starts with a capital); a brand
  there goes unflagged unless it is a place. This is a heuristic, kept because a missed brand
  costs a reading and a false flag costs only a reading too.

Words are compared case-folded with plurals reduced ("Cottons" = "cotton", "berries" = "berry").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

MATERIALS = frozenset("""
acrylic aluminium aluminum bamboo brass bronze canvas cardboard cashmere ceramic chiffon clay copper cotton crepe
denim fleece georgette glass granite iron jute khadi leather linen lycra marble melamine merino microfiber
microfibre modal muslin nylon paper plastic polycotton polyester polypropylene porcelain rayon resin rubber
satin sheesham silicone silk spandex steel stoneware suede teak terracotta titanium velvet viscose wood wooden
wool woollen woolen
""".split())
"""Materials a description may claim ("100% wool"); compared as words of the listing's text."""

COLOURS = frozenset("""
beige black blue brown burgundy charcoal cyan golden green grey gray indigo ivory khaki lavender magenta maroon
multicolor multicolour multicoloured mustard navy olive peach pink purple red teal turquoise violet white yellow
""".split())
"""Colour words. Words that are more often something else in a shop's listings (cream, orange,
lime, gold, silver, rose, chocolate, coffee, wine) are left out: "orange juice" is no colour."""

COLOUR_VALUES = COLOURS | frozenset("""
assorted clear copper cream dark gold light multi orange rose silver transparent
""".split())
"""Words an extracted colour value may hold: :data:`COLOURS` and those a colour field can only
mean as a colour ("Gold", "Silver", "Orange", "Assorted")."""

AUDIENCES = frozenset("""
adult babies baby boy child children couple female gent girl infant junior kid ladies lady male man men
newborn senior teen teenager toddler unisex woman women
""".split())
"""Words an extracted audience value ("Ideal For": "Men", "Baby Girls", "Boys, Girls") may hold."""

EvidenceKind = Literal["listing", "brand", "colour", "material", "audience", "count", "none"]
"""What shows an extracted value right (:data:`weir.jobs.catalog.decisions.EVIDENCE_KINDS`)."""

CONNECTIVES = frozenset("and or with".split())
"""Words that join a value's words ("Men and Women", "Cotton with Polyester")."""

PLACES = frozenset("""
africa african america american asia asian australia australian bangladesh belgian belgium brazil brazilian
britain british canada canadian ceylon china chinese dutch egypt egyptian england english europe european
france french german germany greece greek himalaya himalayan himalayas india indian indonesia irish italian italy
japan japanese kashmir kashmiri kerala korea korean london malaysia mexican mexico mumbai delhi bengal nepal
nepali pakistan paris persian punjab punjabi rajasthan rajasthani scotland scottish spain spanish sri lanka
swiss switzerland thai thailand tibet tibetan turkey turkish uk usa vietnam vietnamese welsh
""".split())
"""Places and the adjectives made from them ("Made in Italy", "Swiss", "Himalayan")."""

CURRENCIES = {"₹": "INR", "rs": "INR", "inr": "INR", "rupee": "INR", "£": "GBP", "gbp": "GBP",
              "$": "USD", "usd": "USD", "dollar": "USD", "€": "EUR", "eur": "EUR", "euro": "EUR",
              "¥": "JPY", "yen": "JPY"}
"""Currency symbols and words (case-folded, singular) -> ISO 4217 code."""

UNITS: dict[str, tuple[str, float]] = {}
for _names, _dimension, _factor in (
        ("mg milligram", "mass", 0.001), ("g gm gms gram gramme grm", "mass", 1.0),
        ("kg kgs kilo kilogram", "mass", 1000.0),
        ("ml millilitre milliliter", "volume", 1.0), ("l ltr litre liter lt", "volume", 1000.0),
        ("mm millimetre millimeter", "length", 1.0), ("cm centimetre centimeter", "length", 10.0),
        ("m metre meter mtr", "length", 1000.0), ("inch in", "length", 25.4), ("ft feet foot", "length", 304.8),
        ("lb lbs pound", "mass", 453.592), ("oz ounce", "mass", 28.3495),
        ("% percent per cent", "percent", 1.0), ("pc pcs piece", "count", 1.0), ("w watt", "power", 1.0),
        ("v volt", "voltage", 1.0), ("mah", "charge", 1.0), ("gb", "bytes", 1.0), ("tb", "bytes", 1000.0),
        ("hour hr hrs", "time", 60.0), ("minute min mins", "time", 1.0), ("day", "time", 1440.0),
        ("year yr yrs", "time", 525600.0), ("month", "time", 43800.0)):
    for _name in _names.split():
        UNITS[_name] = (_dimension, _factor)
UNITS["percent"] = UNITS["%"]
"""Unit word (case-folded, singular) -> (dimension, factor to the dimension's base unit)."""

CLAIMS = frozenset("""
antibacterial antiseptic award certified chemical clinically clinical cure detox dermatologically diabetes
diabetic eco gluten guaranteed hypoallergenic immune immunity natural organic paraben patented preservative proven
sugar sustainable toxic vegan
""".split())
"""Words of a health, safety, origin or certification claim ("clinically proven", "organic",
"boosts immunity", "paraben-free"), which the listing must make itself."""

COMMON_WORDS = frozenset("""
a an and are as at be best buy by can day days each enjoy every for from get good great has have home ideal
in is it its just keep made make new no not now of on or our perfect premium pure quality shop so that the
their these this those to try use with you your yours i i'm i've we we're it's you're he she they what where
when why how there here all any more most both also only if but yet while ayurveda ayurvedic diwali holi
christmas eid
monday tuesday wednesday thursday friday saturday sunday january february march april may june july
august september october november december
""".split())
"""Capitalised words that name no brand or place (a title-cased word inside a sentence, festivals,
days, months); compared case-folded."""

GENERIC_WORDS = frozenset("""
about above across add added adding addition after again against ahead allow along already always amazing
among another anyone anything appeal around attractive available away awesome back balance beautiful
beautifully because become been before being better between beyond big bring bringing brings brilliant
built busy came care carefully carry case certain chance change choice choose chosen classic clean come comes
comfort comfortable complete completely convenient could craft crafted create created creating day daily
delicious delight delightful deliver delivers design designed designs detail details different does doing
done down durable during ease easily easy effortless effortlessly elegant elegance else enhance enhances
enough ensure ensures entire entirely essential even ever everyday everyone everything excellent exceptional
exclusive experience exquisite extra eye family fantastic favourite favorite feature featuring features feel
feeling few find fine finest finish first fit fits flavour flavor flavorful flavourful friend friends fun
functional gift give gives giving go goes going gorgeous grand happy healthy help helps high highest hold
holds ideal important impress include includes including indulge indulgent innovative inside instantly into
item just keeps kind know large last lasting latest life lifestyle light like little live long look looking
looks lot love lovely loved luxurious luxury maintain make makes making many matter may meal meals meet
might modern moment moments much must need needs neat nice occasion occasions offer offered offering offers
one ones option options other out outstanding over own part particular people perfect perfectly personal
piece place pleasure plus popular possible practical preference price product products proper provide
provides providing purpose quick quickly range ready real really refined reliable remarkable rich right
same satisfy satisfying see seeking selection sense set several shape should show simple simply since
sleek small smart smooth solution some something special specially stand standard stay stunning style
stylish such superb superior sure surface take taste tasty than them then thing things think through time
timeless times together top touch treat trendy truly trust turn two ultimate under unique unmatched
unparalleled up upon us used useful user using value variety various versatile very want way ways
well when whether which who whole why will wish without wonderful work works world would year
aesthetic always beauty celebrate close combined convenience customer customers dream durability easier
end enjoying expectation extraordinary fabulous featured highly humble landscape leave leaving legendary
living longevity often precious reach referring reliability require restore routine sought specifically
still task texture toward towards transformed within worry worrying
was were did had his her him off per via whose whom ours theirs itself yourself
""".split())
"""Words a description may use without its listing: praise, generic verbs and nouns ("offers",
"perfect", "stylish", "experience"): general English, and the generic words of the tuning
descriptions' supported texts (``tests/data/grounding/tuning``, never the labelled sample)."""

_TOKEN = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?|\d+", re.UNICODE)  # "500g": "500", "g"
_SYMBOLS = "₹£$€¥"
_NUMBER = r"\d+(?:[.,]\d+)*"
_QUANTITY = re.compile(
    rf"(?P<pre>[{_SYMBOLS}]|\b(?:rs|inr|usd|gbp|eur)\b\.?)?\s*(?P<num>{_NUMBER})(?:\s*(?P<unit>%|[^\W\d_]+\b))?",
    re.IGNORECASE | re.UNICODE)
_CURRENCY_WORD = re.compile(rf"[{_SYMBOLS}]|\b[^\W\d_]+\b", re.UNICODE)
_POSSESSIVE = re.compile(r"['’]s$", re.IGNORECASE)
_SENTENCE_START = re.compile(r"(?:^|[.!?]\s+|\n\s*)$")


class Listing(BaseModel):
    """A product's own text, the evidence its enrichment is checked against: its title, brand,
    source description (empty when the catalog has none) and the catalog's category path."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    brand: str = ""
    description: str = ""
    category: str = ""

    @property
    def text(self) -> str:
        return "\n".join(part for part in (self.name, self.brand, self.description, self.category) if part)


def singular(word: str) -> str:
    """``word`` case-folded with a plural ending taken off ("Berries" -> "berry", "boxes" -> "box",
    "grams" -> "gram"); words of three letters or fewer, and ones ending in "ss", "us" or "is", are kept."""
    word = word.casefold()
    if len(word) <= 3 or word.endswith(("ss", "us", "is")):
        return word
    if word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith(("ches", "shes", "xes", "zes", "sses")):
        return word[:-2]
    if word.endswith("s"):
        return word[:-1]
    return word


def words(text: str) -> list[str]:
    """The words of ``text``, case-folded and singular (:func:`singular`), a possessive's "'s"
    dropped ("Girl's" -> "girl"); hyphenated words are split."""
    return [singular(_POSSESSIVE.sub("", w)) for w in _TOKEN.findall(text)]


def _number(text: str) -> Optional[float]:
    text = text.replace(",", "")
    if text.count(".") > 1:
        return None
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Quantity:
    """A number found in a text: its ``value``, its unit's dimension and the value in that
    dimension's base unit (None without a known unit), its currency code if any, and the text."""

    value: float
    dimension: Optional[str]
    base: Optional[float]
    currency: Optional[str]
    text: str
    unit: Optional[str] = None
    """The unit's name as :data:`UNITS` spells it (singular, case-folded), or None."""


def quantities(text: str) -> list[Quantity]:
    """Every number of ``text`` with the unit after it or the currency around it (a known unit of
    :data:`UNITS`, a currency of :data:`CURRENCIES` before it, or a currency word after it:
    "99 rupees")."""
    found = []
    for match in _QUANTITY.finditer(text):
        value = _number(match["num"])
        if value is None:
            continue
        pre, unit = match["pre"], match["unit"]
        currency = CURRENCIES.get(pre.rstrip(".").casefold()) if pre else None
        dimension = base = name = None
        shown = match.group(0).strip()
        if unit is not None:
            name = singular(unit)
            if name in UNITS:
                dimension, factor = UNITS[name]
                base = round(value * factor, 6)
            elif currency is None and name in CURRENCIES:
                currency = CURRENCIES[name]
            else:
                shown = match.group(0)[:match.start("unit") - match.start(0)].strip()
        found.append(Quantity(value, dimension, base, currency, shown, name if dimension is not None else None))
    return found


def _currencies(text: str) -> set[str]:
    return {CURRENCIES[singular(w.rstrip("."))] for w in _CURRENCY_WORD.findall(text)
            if singular(w.rstrip(".")) in CURRENCIES}


@dataclass(frozen=True)
class Evidence:
    """What a listing supports, prepared once: its words, its numbers (as values and as
    quantities in base units) and its currencies."""

    words: frozenset[str]
    values: frozenset[float]
    measures: frozenset[tuple[str, float]]
    units: frozenset[tuple[str, float]]
    currencies: frozenset[str]
    text: str

    @classmethod
    def of(cls, listing: Listing) -> "Evidence":
        text = listing.text
        found = quantities(text)
        return cls(frozenset(words(text)), frozenset(q.value for q in found),
                   frozenset((q.dimension, q.base) for q in found if q.dimension is not None),
                   frozenset(UNITS[q.unit] for q in found if q.unit is not None),
                   frozenset(_currencies(text)), " ".join(words(text)))

    def supports_quantity(self, q: Quantity) -> Optional[str]:
        """None when the listing holds ``q``, else the reason's code."""
        if q.currency is not None:
            return None if q.currency in self.currencies and q.value in self.values else "unsupported_price"
        if q.dimension is not None:
            if (q.dimension, q.base) in self.measures:
                return None
            return "unsupported_unit" if q.value in self.values else "unsupported_number"
        return None if q.value in self.values else "unsupported_number"

    def supports_phrase(self, text: str) -> bool:
        """Whether every word of ``text`` is a word of the listing, in the same order and together
        (a phrase of several words), or the whole of ``text`` is one of its numbers."""
        phrase = words(text)
        if not phrase:
            return True
        if len(phrase) == 1 and phrase[0] in UNITS:  # "kg" where the listing says "1 kilogram"
            return phrase[0] in self.words or UNITS[phrase[0]] in self.units
        if len(phrase) == 1:
            return phrase[0] in self.words
        return f" {' '.join(phrase)} " in f" {self.text} "


def reason(code: str, text: Optional[str] = None, field: Optional[str] = None) -> dict[str, Any]:
    """One reason as stored: ``{"code": ..., "text": ...}``, with ``field`` for an attribute."""
    out: dict[str, Any] = {"code": code}
    if field is not None:
        out["field"] = field
    if text is not None:
        out["text"] = text
    return out


def unsupported_claims(text: str, listing: Listing) -> list[dict[str, Any]]:
    """The reasons (in the order the text gives them, each claim once) why ``text`` says more than
    ``listing``: see the module's docstring for the codes. ``[]`` when everything it states that
    this check reads is in the listing."""
    evidence = Evidence.of(listing)
    reasons: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()

    def add(code: str, shown: str) -> None:
        if (code, shown.casefold()) not in seen:
            seen.add((code, shown.casefold()))
            reasons.append(reason(code, shown))

    priced: set[str] = set()
    for q in quantities(text):
        code = evidence.supports_quantity(q)
        if q.currency is not None:
            priced.add(q.currency)
        if code is not None:
            add(code, q.text)
    for currency in sorted(_currencies(text) - priced - evidence.currencies):
        shown = next(w for w in _CURRENCY_WORD.findall(text) if CURRENCIES.get(singular(w.rstrip("."))) == currency)
        add("unsupported_currency", shown)
    for match in _TOKEN.finditer(text):
        raw, word = match.group(0), singular(match.group(0))
        if word in evidence.words:
            continue
        if word in MATERIALS:
            add("unsupported_material", raw)
        elif word in COLOURS:
            add("unsupported_colour", raw)
        elif word in PLACES:
            add("unsupported_place", raw)
        elif word in CLAIMS:
            add("unsupported_claim", raw)
        elif (raw[0].isupper() and word not in COMMON_WORDS and word not in CURRENCIES and word not in UNITS
              and not _SENTENCE_START.search(text[:match.start()])):
            add("unsupported_name", raw)
    return reasons


def _stem(word: str) -> str:
    for suffix in ("ing", "ed", "ly", "er", "est", "ness", "ful", "ive", "al", "y", "e"):
        if len(word) > len(suffix) + 3 and word.endswith(suffix):
            return word[:-len(suffix)]
    return word


def unlisted_words(text: str, listing: Listing) -> list[str]:
    """The content words of ``text`` its listing does not hold, in order, each once: words of three
    letters or more that are neither the listing's (case, plural and a common suffix aside:
    "designed" = "design") nor :data:`COMMON_WORDS`, :data:`GENERIC_WORDS`, units or currencies."""
    own = set(words(listing.text))
    stems = {_stem(w) for w in own}
    found: list[str] = []
    for word in words(text):
        if (len(word) < 3 or word.isdigit() or word in own or _stem(word) in stems or word in COMMON_WORDS
                or word in GENERIC_WORDS or word in UNITS or word in CURRENCIES or word in found):
            continue
        found.append(word)
    return found


def names_the_product(text: str, listing: Listing) -> bool:
    """Whether ``text`` holds a word of the product's title or brand (of three letters or more,
    not one of :data:`COMMON_WORDS`): a description that names neither ("Sounds like a wonderful
    idea!") is about something else."""
    own = {w for w in words(f"{listing.name} {listing.brand}") if len(w) > 2 and w not in COMMON_WORDS
           and not w.isdigit()}
    return not own or bool(own & set(words(text)))

