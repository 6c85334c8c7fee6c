"""IncrementalDetokenizer: streamed text equals a full decode; stop strings cut it at the right place."""

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from weir.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

IM_END = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tok():
    from weir.engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def byte_tok():
    """A byte-level BPE tokenizer with no merges: one token per UTF-8 byte, plus <|end|> (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")


class DecodeOnly:
    """A tokenizer with ``decode`` but no ``backend_tokenizer``: forces the window decoder."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, **kwargs):
        return self._tok.decode(ids, **kwargs)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, chunks=None, **kwargs):
    """Feed ids (one by one, or in the given chunk sizes); returns (detok, texts after each update, stop)."""
    det = IncrementalDetokenizer(tok, [1, 2, 3], **kwargs)
    chunks = chunks or [1] * len(ids)
    texts, pos = [], 0
    for n in chunks:
        stop = det.update(ids[pos:pos + n])
        pos += n
        texts.append(det.output_text)
        if stop is not None:
            return det, texts, stop
    det.finish()
    return det, texts, None


def random_chunks(n, seed):
    rng, chunks = random.Random(seed), []
    while n > 0:
        chunks.append(min(n, rng.randint(1, 4)))
        n -= chunks[-1]
    return chunks


# --- text equals a full decode ---------------------------------------------------------------------

def test_emoji_split_over_byte_tokens_is_held_until_complete(tok):
    ids = encode(tok, "Fresh 🍎🥭 mango")
    assert [tok.decode([i]) for i in ids][1] == " " + REPLACEMENT_CHAR  # 🍎 spans 3 tokens
    det, texts, stop = stream(tok, ids)
    assert texts == ["Fresh", "Fresh", "Fresh", "Fresh 🍎", "Fresh 🍎", "Fresh 🍎", "Fresh 🍎🥭",
                     "Fresh 🍎🥭 mango"]
    assert (det.output_text, stop, det.token_ids) == ("Fresh 🍎🥭 mango", None, ids)


@pytest.mark.parametrize("text", ["👨‍👩‍👧‍👦 family", "日本語のテキスト", "ताज़ा आम",
                                  "Hello, world. It's 5 p.m.!", "  two  spaces\n\nand\ttab "])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_final_text_equals_full_decode_without_replacement_chars(tok, text, seed):
    ids = encode(tok, text)
    det, texts, _ = stream(tok, ids, random_chunks(len(ids), seed) if seed is not None else None)
    assert det.output_text == tok.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT_CHAR in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_devanagari_intermediate_texts(tok):
    _, texts, _ = stream(tok, encode(tok, "ताज़ा आम"))
    assert texts == ["त", "ता", "ता", "ताज", "ताज", "ताज़", "ताज़ा", "ताज़ा", "ताज़ा आ", "ताज़ा आम"]


def test_punctuation_spacing_token_by_token(tok):
    _, texts, _ = stream(tok, encode(tok, "Hello, world. It's 5 p.m.!"))
    assert texts == ["Hello", "Hello,", "Hello, world", "Hello, world.", "Hello, world. It",
                     "Hello, world. It's", "Hello, world. It's ", "Hello, world. It's 5",
                     "Hello, world. It's 5 p", "Hello, world. It's 5 p.", "Hello, world. It's 5 p.m",
                     "Hello, world. It's 5 p.m.", "Hello, world. It's 5 p.m.!"]


def test_first_token_keeps_its_leading_space_and_prompt_never_leaks(tok):
    prompt = encode(tok, "<|im_start|>user\nGreet me<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(tok, " Sure, hi")
    det = IncrementalDetokenizer(tok, prompt)
    det.update(ids[:1])
    assert det.output_text == " Sure"
    for i in ids[1:]:
        det.update([i])
    det.finish()
    assert det.output_text == " Sure, hi"


@pytest.mark.parametrize("skip, want", [(True, "Hello world"), (False, "Hello<|im_end|> world<|im_end|>")])
def test_special_tokens_in_the_middle(tok, skip, want):
    ids = encode(tok, "Hello") + [IM_END] + encode(tok, " world") + [IM_END]
    det, texts, _ = stream(tok, ids, skip_special_tokens=skip)
    assert det.output_text == tok.decode(ids, skip_special_tokens=skip) == want
    assert texts[1] == ("Hello" if skip else "Hello<|im_end|>")


def test_output_ending_in_an_incomplete_character_is_released_by_finish(tok):
    ids = encode(tok, "x🍎")[:-1]
    det = IncrementalDetokenizer(tok, [])
    for i in ids:
        det.update([i])
    assert det.output_text == "x"
    det.finish()
    assert det.output_text == tok.decode(ids) == "x" + REPLACEMENT_CHAR


def test_invalid_bytes_in_the_middle_match_full_decode(tok):
    ids = encode(tok, "🍎")[:1] + encode(tok, "ab")
    det, texts, _ = stream(tok, ids)
    assert texts == ["", REPLACEMENT_CHAR + "ab"]
    assert det.output_text == tok.decode(ids)


def test_deltas_concatenate_to_the_final_text(tok):
    ids = encode(tok, "Fresh 🍎 ताज़ा")
    det = IncrementalDetokenizer(tok, [])
    deltas = []
    for i in ids:
        det.update([i])
        deltas.append(det.get_next_output_text(delta=True))
    det.finish()
    deltas.append(det.get_next_output_text(delta=True))
    assert deltas[:4] == ["Fresh", "", "", " 🍎"]
    assert "".join(deltas) == det.get_next_output_text(delta=False) == "Fresh 🍎 ताज़ा"


def test_fast_tokenizers_use_the_tokenizers_decode_stream(tok):
    from weir.engine.detokenizer import _LibraryDecoder, _WindowDecoder

    assert isinstance(IncrementalDetokenizer(tok, [])._decoder, _LibraryDecoder)
    assert isinstance(IncrementalDetokenizer(DecodeOnly(tok), [])._decoder, _WindowDecoder)


def test_window_decoder_for_tokenizers_without_a_backend(tok):
    ids = encode(tok, "Fresh 🍎🥭 ताज़ा") + [IM_END] + encode(tok, " 日本")
    for skip in (True, False):
        det, texts, _ = stream(DecodeOnly(tok), ids, random_chunks(len(ids), 3), skip_special_tokens=skip)
        assert det.output_text == tok.decode(ids, skip_special_tokens=skip)
        assert not any(REPLACEMENT_CHAR in t for t in texts)


def test_window_decoder_takes_over_when_the_library_stream_fails(tok):
    class FailsOnThirdStep:
        def __init__(self, inner):
            self.inner, self.num_steps = inner, 0

        def step(self, ids):
            self.num_steps += 1
            if self.num_steps == 3:
                raise Exception("InvalidPrefix")
            return self.inner.step(ids)

    ids = encode(tok, "Fresh 🍎🥭 mango")
    det = IncrementalDetokenizer(tok, [])
    det._decoder = FailsOnThirdStep(det._decoder)
    texts = []
    for i in ids:
        det.update([i])
        texts.append(det.output_text)
    det.finish()
    assert texts == ["Fresh", "Fresh", "Fresh", "Fresh 🍎", "Fresh 🍎", "Fresh 🍎", "Fresh 🍎🥭",
                     "Fresh 🍎🥭 mango"]


def test_update_after_a_stop_string_raises(tok):
    det = IncrementalDetokenizer(tok, [], stop=["Hello"])
    assert det.update(encode(tok, "Hello")) == "Hello"
    with pytest.raises(RuntimeError):
        det.update(encode(tok, " world"))
    det.finish()
    assert det.output_text == ""


# --- stop strings ----------------------------------------------------------------------------------

TEXT = "The word abcd is here"


def test_stop_string_premises(tok):
    assert [tok.decode([i]) for i in encode(tok, TEXT)] == ["The", " word", " ab", "cd", " is", " here"]


@pytest.mark.parametrize("stop, include, want_text, want_stop, num_updates", [
    (["or"], False, "The w", "or", 2),                      # inside one token
    (["or"], True, "The wor", "or", 2),
    (["rd abcd"], False, "The wo", "rd abcd", 4),           # across three tokens
    (["rd abcd"], True, "The word abcd", "rd abcd", 4),
    (["The"], False, "", "The", 1),                         # at the very start
    (["The"], True, "The", "The", 1),
    (["here", "word"], False, "The ", "word", 2),           # later-listed matches earlier in the text
    (["here", "word"], True, "The word", "word", 2),
    (["is here", "s h", "xyz"], False, "The word abcd i", "s h", 6),
    (["", "zz"], False, TEXT, None, 6),                     # empty stop strings never match
])
def test_stop_strings(tok, stop, include, want_text, want_stop, num_updates):
    ids = encode(tok, TEXT)
    for chunks in (None, random_chunks(len(ids), 7)):
        det, texts, matched = stream(tok, ids, chunks, stop=stop, include_stop_str_in_output=include)
        assert (det.output_text, matched) == (want_text, want_stop)
        if chunks is None:
            assert len(texts) == num_updates


def test_stop_string_that_ends_first_wins_over_one_that_starts_first(tok):
    det, _, matched = stream(tok, encode(tok, TEXT), [6], stop=["word abcd", "rd"])
    assert (det.output_text, matched) == ("The wo", "rd")


def test_held_prefix_of_a_stop_string_is_released_by_finish(tok):
    ids = encode(tok, "The word ab")
    det = IncrementalDetokenizer(tok, [], stop=["abcd"])
    deltas = []
    for i in ids:
        assert det.update([i]) is None
        deltas.append(det.get_next_output_text(delta=True))
    assert det.output_text == "The word "
    det.finish()
    assert det.output_text == "The word ab"
    assert deltas + [det.get_next_output_text(delta=True)] == ["The", " word", " ", "ab"]


def test_held_prefix_that_does_not_match_is_released_by_later_tokens(tok):
    _, texts, matched = stream(tok, encode(tok, TEXT), stop=["abcx", "d iz"])
    assert matched is None
    assert texts == ["The", "The wor", "The word ", "The word abc", "The word abcd is",
                     "The word abcd is here"]


def test_stop_string_with_multibyte_characters(tok):
    ids = encode(tok, "Fresh 🍎🥭 mango")
    det, texts, matched = stream(tok, ids, stop=["🍎🥭"])
    assert (det.output_text, matched, texts[-1]) == ("Fresh ", "🍎🥭", "Fresh ")
    assert texts[3] == "Fresh "  # 🍎 is held: it begins the stop string


# --- properties ------------------------------------------------------------------------------------

PIECES = st.one_of(
    st.characters(codec="utf-8"),
    st.sampled_from(list("abc ,.!?\n") + ["🍎", "🥭", "👨\u200d👩\u200d👧", "日", "本", "語", "テ",
                                           "त", "ा", "ज़", "आ", "म", "\u093c", "\u200d", " ताज़ा"]),
)


def texts(min_size=0, max_size=20):
    """Unicode text mixing any character with emoji (ZWJ sequences), CJK and Devanagari."""
    return st.lists(PIECES, min_size=min_size, max_size=max_size).map("".join)


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(text=texts(), seed=st.integers(0, 2**16), skip=st.booleans())
def test_property_stream_equals_full_decode(tok, text, seed, skip):
    ids = encode(tok, text)
    ids[len(ids) // 2:len(ids) // 2] = [IM_END]
    det, texts, _ = stream(tok, ids, random_chunks(len(ids), seed), skip_special_tokens=skip)
    assert det.output_text == tok.decode(ids, skip_special_tokens=skip)


@SETTINGS
@given(text=texts(), seed=st.integers(0, 2**16))
def test_property_deltas_concatenate_to_full_decode(byte_tok, text, seed):
    ids = encode(byte_tok, text)
    det = IncrementalDetokenizer(byte_tok, [])
    deltas, pos = [], 0
    for n in random_chunks(len(ids), seed):
        det.update(ids[pos:pos + n])
        pos += n
        deltas.append(det.get_next_output_text(delta=True))
        assert REPLACEMENT_CHAR not in deltas[-1] or REPLACEMENT_CHAR in text
    det.finish()
    deltas.append(det.get_next_output_text(delta=True))
    assert "".join(deltas) == det.output_text == byte_tok.decode(ids, skip_special_tokens=True)


@SETTINGS
@given(text=texts(min_size=1), data=st.data(), include=st.booleans())
def test_property_stop_strings_do_not_depend_on_chunking(tok, text, data, include):
    ids = encode(tok, text)
    full = tok.decode(ids)
    assume(REPLACEMENT_CHAR not in full)  # text left in the decoder (ends in U+FFFD) is never searched
    assume(full)  # a text of control characters the tokenizer drops ("\x16") holds no stop string
    stops = [data.draw(texts(min_size=1, max_size=2)) for _ in range(2)]
    i = data.draw(st.integers(0, len(full) - 1))
    stops.append(full[i:i + data.draw(st.integers(1, 5))])
    ends = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    end, start, want_stop = min(ends)
    want_text = full[:end if include else start]
    for chunks in (None, random_chunks(len(ids), data.draw(st.integers(0, 99))), [len(ids)]):
        det, _, matched = stream(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
        assert (det.output_text, matched) == (want_text, want_stop)
