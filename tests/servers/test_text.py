"""Streamed text equals the whole decode, across multi-byte characters, and stops before a stop string."""
from types import SimpleNamespace

import pytest

from servers.text import Detokenizer


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


def stream(tok, ids, stop=()):
    d = Detokenizer(tok, list(stop))
    pieces = [d.add(t) for t in ids] + [d.add(None, final=True)]
    return pieces, d


def test_pieces_join_to_the_whole_decode_with_multibyte(tok):
    ids = tok.encode("Zürich → 東京 ✓ naïve café 🙂 done")
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_cuts_before_it(tok):
    ids = tok.encode("alpha beta STOP gamma delta")
    pieces, d = stream(tok, ids, stop=["STOP"])
    assert "".join(pieces) == "alpha beta " and d.stopped


@pytest.mark.parametrize("window", [False, True], ids=["rust-stream", "window"])
def test_both_decoders_stream_the_whole_decode_and_cut_at_a_stop_split_across_tokens(tok, window):
    """A stop string that spans several tokens is cut wherever it starts; text before it is all emitted, whichever
    decoder (the backend's DecodeStream or the window one, for tokenizers without a Rust backend) made it."""
    text = "Zürich → 東京 ✓ naïve café 🙂 done; the end"
    ids = tok.encode(text)
    d = Detokenizer(SimpleNamespace(decode=tok.decode) if window else tok, ["the e", "zzz"])
    pieces = [d.add(t) for t in ids] + [d.add(None, final=True)]
    assert "".join(pieces) == text[:text.index("the e")] and d.stopped
    assert not any("\ufffd" in p for p in pieces)
