"""Attribute extraction: the prompt that asks a product's attributes under the job spec's schema
(``[extract]``, :class:`weir.jobs.catalog.spec.Extract`).

The output is constrained by the schema (``SamplingParams.structured_outputs``), so every finished
output parses and validates; the schema's fields are nullable so that the model can say a listing
does not tell. The catalogs' ground truth that the answers are scored against is read by
``bench/ground_truth.py``, outside the package.
"""

from __future__ import annotations

import json

from weir.jobs.catalog.spec import Extract


def listing_text(name: str, description: str, description_chars: int) -> str:
    """What the model reads of one product: its name and the first ``description_chars``
    characters of its description (whitespace collapsed; ``none`` when empty)."""
    description = " ".join(description.split())[:description_chars]
    return f"Product: {name}\nDescription: {description or 'none'}"


def extraction_messages(extract: Extract, shop: str, name: str, description: str) -> list[dict[str, str]]:
    """Chat messages asking for one product's attributes: the system prompt (naming the fields in
    order), then the worked examples (each a listing and its answer; the same for every product,
    so a cached prefix), then the product's listing."""
    system = f"{extract.system_prompt.format(shop=shop)} Fields: {', '.join(extract.fields)}."
    messages = [{"role": "system", "content": system}]
    for example_name, example_description, answer in extract.worked_examples():
        messages.append({"role": "user", "content": listing_text(example_name, example_description,
                                                                 extract.description_chars)})
        messages.append({"role": "assistant", "content": json.dumps(answer, separators=(", ", ": "), ensure_ascii=False)})
    messages.append({"role": "user", "content": listing_text(name, description, extract.description_chars)})
    return messages
