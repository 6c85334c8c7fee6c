"""Few-shot exemplars for classification: a product's nearest already-labelled products.

Similarity is TF-IDF cosine over character n-grams (3 to 5, within word bounds) of the product's
name and brand (scikit-learn's ``TfidfVectorizer``, sublinear tf): cheap, language-neutral, and
robust to the misspellings and mojibake of real catalogs. Exemplars are drawn from a leave-one-out
pool: never the product itself (same id), nor any row whose title is the product's own (titles
compared case-folded with whitespace collapsed), so a duplicate listing never shows the answer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def title_key(name: str) -> str:
    """A title as compared for duplicates: case-folded, whitespace runs collapsed."""
    return " ".join(name.casefold().split())


@dataclass(frozen=True)
class Labelled:
    """One pool entry: a product whose catalog category is known."""

    product_id: str
    name: str
    brand: str
    label: str

    @property
    def text(self) -> str:
        return f"{self.name} {self.brand}".strip()


class ExemplarIndex:
    """A TF-IDF index over a pool of labelled products; answers nearest-neighbour queries.

    Owns the fitted vectorizer and the pool's normalised document matrix (``[num_pool, num_features]``,
    sparse). The pool is fixed at construction.

    Args:
        pool: the labelled products (ids need not be unique; titles may repeat).

    Raises:
        ValueError: the pool is empty.
    """

    def __init__(self, pool: Sequence[Labelled]):
        if not pool:
            raise ValueError("the exemplar pool is empty: no product has a category")
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.pool = list(pool)
        self.vectorizer = TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), sublinear_tf=True,
                                          lowercase=True, dtype=np.float32)
        self.matrix = self.vectorizer.fit_transform([p.text for p in self.pool])
        self._keys = [title_key(p.name) for p in self.pool]

    def nearest(self, product_id: str, name: str, brand: str, k: int) -> list[Labelled]:
        """The ``k`` pool products most similar to one product, least similar first (the nearest
        sits next to the query in a prompt), distinct by title.

        Never returns a pool entry with the product's id or with its title (see :func:`title_key`).
        Ties in similarity keep pool order. Fewer than ``k`` come back when the pool has fewer
        eligible titles.
        """
        return [self.pool[i] for i, _ in reversed(self._ranked(product_id, name, brand, k))]

    def vote(self, product_id: str, name: str, brand: str, k: int) -> dict[str, float]:
        """kNN vote without a model: each label's summed similarity over the ``k`` nearest
        eligible pool products (same exclusions as :meth:`nearest`)."""
        votes: dict[str, float] = defaultdict(float)
        for i, sim in self._ranked(product_id, name, brand, k):
            votes[self.pool[i].label] += sim
        return dict(votes)

    def _ranked(self, product_id: str, name: str, brand: str, k: int) -> list[tuple[int, float]]:
        query = self.vectorizer.transform([f"{name} {brand}".strip()])
        sims = (self.matrix @ query.T).toarray().ravel()  # [num_pool]
        order = np.argsort(-sims, kind="stable")
        own, seen = title_key(name), set()
        chosen: list[tuple[int, float]] = []
        for i in order:
            p, key = self.pool[i], self._keys[i]
            if p.product_id == product_id or key == own or key in seen:
                continue
            seen.add(key)
            chosen.append((int(i), float(sims[i])))
            if len(chosen) == k:
                break
        return chosen
