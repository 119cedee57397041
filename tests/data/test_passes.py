"""nemo_ssa.data.passes: the tokens a run reads over its training split, from the indexed
dataset's files; the note appears past one pass only."""

import struct

import pytest

from nemo_ssa.data.passes import corpus_tokens, passes_note, training_passes


def _dataset(tmp_path, n_tokens, code=8, itemsize=2):
    prefix = str(tmp_path / "c_text_document")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + b"\x00" * 16)
    with open(prefix + ".bin", "wb") as f:
        f.write(b"\x00" * (n_tokens * itemsize))
    return prefix


def test_tokens_and_passes(tmp_path):
    p = _dataset(tmp_path, 100_000)
    assert corpus_tokens(p) == 100_000
    assert training_passes(p, max_steps=10, global_batch_size=4, seq_length=1000, train_fraction=1.0) == \
        pytest.approx(0.4)
    assert passes_note(p, max_steps=10, global_batch_size=4, seq_length=1000) is None
    note = passes_note(p, max_steps=100, global_batch_size=4, seq_length=1000)
    assert note is not None and "4.0 passes" in note and "0.4M tokens" in note and "memorization" in note


def test_int32_items_and_bad_headers(tmp_path):
    p = _dataset(tmp_path, 1000, code=4, itemsize=4)
    assert corpus_tokens(p) == 1000
    with open(p + ".idx", "r+b") as f:
        f.seek(17)
        f.write(b"\x63")
    with pytest.raises(ValueError, match="dtype code 99"):
        corpus_tokens(p)
    with open(p + ".idx", "wb") as f:
        f.write(b"NOTANIDX")
    with pytest.raises(ValueError, match="bad header"):
        corpus_tokens(p)
    assert passes_note(p, max_steps=1, global_batch_size=1, seq_length=1) is None  # unreadable: no claim


def test_the_embedded_corpus_is_read_more_than_once_by_the_sweep():
    # the learning-rate sweep of docs/results/2026-11-27-lr-sweep: 1,000 steps x 32 x 1024
    import os

    from nemo_ssa.data import default_corpus_dir

    prefix = os.path.join(default_corpus_dir(), "corpus_text_document")
    if not os.path.isfile(prefix + ".bin"):
        pytest.skip("the embedded corpus is not built here")
    assert training_passes(prefix, max_steps=1000, global_batch_size=32, seq_length=1024) > 3
