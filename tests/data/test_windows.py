"""CPT documents longer than max_length become windows: nothing truncated, every token a
target once (stride < max_length), unique example ids, and a log line per source."""

import logging

import pytest

from distill.data import DistillDataModule
from distill.data.tokenize import cpt_windows


@pytest.mark.parametrize("n,length", [(1, 4), (2, 2), (4, 4), (5, 4), (37, 8), (100, 7)])
@pytest.mark.parametrize("stride_of", ["one", "half", "default", "full"])
def test_windows_cover_the_document_and_train_each_target_once(n, length, stride_of):
    stride = {"one": 1, "half": max(1, length // 2), "default": None, "full": length}[stride_of]
    ids = list(range(100, 100 + n))  # a token's value says where it sits in the document
    windows = cpt_windows(ids, length, stride)
    targets = []
    for window, labels in windows:
        start = window[0] - 100
        assert window == ids[start:start + length]  # a contiguous slice of the document
        assert len(window) == min(length, n) and len(labels) == len(window)
        targets += [y - 100 for y in labels[1:] if y != -100]  # what the model predicts
        assert all(y in (-100, t) for y, t in zip(labels, window))
    assert windows[0][0][0] == 100 and windows[-1][0][-1] == ids[-1]  # first and last token
    assert len(targets) == len(set(targets))  # no target twice
    if stride is None or stride < length:
        assert sorted(targets) == list(range(1, n))  # every token but the first, once
    else:  # a window that starts where the previous one ended has no context for its first
        starts = [w[0] - 100 for w, _ in windows]
        lost = {s for s, prev in zip(starts[1:], starts) if s == prev + length}
        assert sorted(targets) == sorted(set(range(1, n)) - lost)
        assert len(lost) == max(0, len(windows) - 2 + (n % length == 0))
    if n > length:
        step = length - 1 if stride is None else stride
        assert len(windows) == -(-(n - length) // step) + 1


def test_bad_stride_is_refused():
    for stride in (0, 9, -1):
        with pytest.raises(ValueError, match=f"data.cpt_stride={stride} must be between 1 and "
                                             r"data.max_length \(8\)"):
            cpt_windows(list(range(20)), 8, stride)


def test_long_documents_become_windows_with_unique_ids(tiny_assets, tmp_path, caplog):
    from distill.models.causal_lm import load_tokenizer

    tok = load_tokenizer(str(tiny_assets["teacher"]))
    text = "one two three four five six seven eight nine ten"
    (tmp_path / "c.txt").write_text(f"{text}\nshort\n")
    dm = DistillDataModule(tok, train=[{"name": "c", "kind": "cpt",
                                        "path": str(tmp_path / "c.txt")}], max_length=16)
    with caplog.at_level(logging.INFO, logger="distill.data.tokenize"):
        dm.setup("fit")
    rows = dm.train_set.to_list()
    ids = [r["example_id"] for r in rows]
    n = len(text) + 2  # one token a character, plus bos and eos
    assert ids == [f"c:0.{k}" for k in range(-(-(n - 16) // 15) + 1)] + ["c:1"]
    tokens = [t for r in rows[:-1] for t, y in zip(r["input_ids"], r["labels"]) if y != -100]
    assert tokens[1:] == tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert f"data source 'c' (cpt): 2 rows -> {len(ids)} examples" in caplog.text
