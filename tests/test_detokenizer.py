"""Incremental detokenization: pieces concatenate to decode(prompt + output) -
decode(prompt), never carry a broken character, and stop strings cut cleanly."""
import pytest
from transformers import AutoTokenizer

from backends.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world, how are you?", " Ça coûte 10 €, déjà vu", "東京は日本の首都です。",
         "Emoji: 🙂🚀👍🏽 done", "mixed 中文 and ascii\nnew line"]


@pytest.fixture(scope="module")
def tok(default_model):
    return AutoTokenizer.from_pretrained(default_model)


def stream(tok, prompt_ids, output_ids, stop=()):
    d = IncrementalDetokenizer(tok, prompt_ids, stop)
    pieces = []
    for t in output_ids:
        d.add(t)
        pieces.append(d.take(final=False))
        if d.stopped:
            break
    pieces.append(d.take(final=True))
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_equal_full_decode_difference(tok, text):
    prompt = tok("Say:").input_ids
    out = tok(text).input_ids
    pieces, _ = stream(tok, prompt, out)
    full = tok.decode(prompt + out, skip_special_tokens=True)
    assert "".join(pieces) == full[len(tok.decode(prompt, skip_special_tokens=True)):]
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_character_waits_for_its_last_byte(tok):
    out = tok("🚀").input_ids
    assert len(out) > 1  # the emoji spans several byte-level tokens
    pieces, _ = stream(tok, tok("x").input_ids, out)
    assert pieces[:len(out) - 1] == [""] * (len(out) - 1)
    assert "".join(pieces) == "🚀"


def test_stop_string_is_cut_and_held_back(tok):
    out = tok("The answer is 42. END of story").input_ids
    pieces, d = stream(tok, tok("Q:").input_ids, out, stop=(" END",))
    assert d.stopped
    assert "".join(pieces) == "The answer is 42."
    assert not any("E" in p for p in pieces)


def test_stop_string_split_across_tokens(tok):
    out = tok("abc<|stop|>def").input_ids
    pieces, d = stream(tok, [], out, stop=("<|stop|>",))
    assert d.stopped and "".join(pieces) == "abc"
