"""Exemplar selection: nearest labelled products by TF-IDF, never the product itself nor its title."""

import pytest

from weir.jobs.catalog.exemplars import ExemplarIndex, Labelled, title_key

POOL = [
    Labelled("1", "Green Tea Bags", "Leafy", "Beverages"),
    Labelled("2", "green  tea bags ", "Leafy", "Beverages"),  # product 1's title again
    Labelled("3", "Green Tea Leaves", "Leafy", "Beverages"),
    Labelled("4", "Green Tea Leaves", "Other", "Beverages"),  # a repeated title, shown once
    Labelled("5", "Potato Chips Salted", "Crunch", "Snacks"),
    Labelled("6", "Green Chilli Chips", "Crunch", "Snacks"),
]


def ids(found):
    return [p.product_id for p in found]


def test_title_key():
    assert title_key("  Green\tTea  BAGS ") == "green tea bags"


def test_nearest_never_the_product_nor_its_title_least_similar_first():
    index = ExemplarIndex(POOL)
    assert ids(index.nearest("1", "Green Tea Bags", "Leafy", 3)) == ["5", "6", "3"]
    # a new product (id not in the pool) with a pooled title is not shown that title either
    assert ids(index.nearest("99", "Green Tea Bags", "Leafy", 2)) == ["6", "3"]
    # an unseen title sees every title once; the two chips share no n-gram with it (similarity 0,
    # ranked in pool order, so listed in reverse)
    assert ids(index.nearest("99", "Tea Bags", "", 10)) == ["6", "5", "3", "1"]


def test_vote_sums_similarity_per_label():
    votes = ExemplarIndex(POOL).vote("5", "Potato Chips Salted", "Crunch", 2)
    assert set(votes) == {"Snacks", "Beverages"}
    assert max(votes, key=votes.get) == "Snacks"


def test_empty_pool_is_refused():
    with pytest.raises(ValueError, match="the exemplar pool is empty"):
        ExemplarIndex([])
