"""The description check: unfinished sentences and 4-gram loops are flagged, exact values."""

import pytest

from weir.jobs.catalog.quality import description_quality, repeated_ngram


@pytest.mark.parametrize("text, expected", [
    ("A soft cotton towel for everyday use.", "ok"),
    ("Bright, fresh and ready to serve!", "ok"),
    ('Called "the best tea."', "ok"),
    ("A gift for her (and him.)", "ok"),
    ("Ein schöner Becher.", "ok"),
    ("", "empty"),
    ("   \n", "empty"),
    (None, "empty"),
    ("A soft cotton towel for everyday", "unfinished"),
    ("A soft cotton towel,", "unfinished"),
    ("Fast 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs.", "repetitive"),
    ("Fast 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs 1000mbs", "unfinished,repetitive"),
    # one 4-gram seen exactly twice is allowed, three times is not
    ("red cup of tea and red cup of tea.", "ok"),
    ("red cup of tea, red cup of tea, Red Cup Of Tea.", "repetitive"),
    # a ". " stop string cut after an abbreviation inside the sentence
    ("A bespoke watch designed by the renowned designer, Dr.", "unfinished"),
    ("The Prestige pressure cooker Model No.", "unfinished"),
    ("A steel bottle (e.g.", "unfinished"),
    ("A pack of six for Rs.", "unfinished"),
    ("S.C.", "unfinished"),
    ("The Cookart Elegant S.S.", "unfinished"),
    ("Say no.", "ok"),
    ("Made by Shree Foods Pvt. Ltd.", "ok"),
    ("Rich in vitamin C.", "ok"),
    # a heading line (the title echoed) before the sentence is not a finished sentence
    ("Exotic India Relaxing Ganesha Showpiece  \nThis exquisite piece is carved by hand.", "unfinished"),
    ("A soft towel.\nIt dries fast.", "ok"),
])
def test_description_quality(text, expected):
    assert description_quality(text) == expected


def test_repeated_ngram_counts_case_folded_words():
    assert repeated_ngram("a b c d A B C D a b c d") == ("a b c d", 3)
    assert repeated_ngram("a b c") is None


def test_pick_description_keeps_the_first_clean_attempt_else_the_first():
    from weir.jobs.catalog.quality import pick_description

    assert pick_description(["Green tea from Assam", "A fine green tea."]) == 1
    assert pick_description(["A fine green tea.", "Another fine tea."]) == 0
    assert pick_description(["Green tea from", "tea tea tea tea tea tea tea tea tea tea tea tea"]) == 0
    assert pick_description([None, ""]) == 0
