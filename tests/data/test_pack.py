"""Sequence packing: rows, batches, and that a packed row computes what its documents do
alone (hidden states, loss, gradients)."""

import random

import datasets
import pytest
import torch

from distill.data.collate import PadCollator
from distill.data.masks import batch_masks, local_step_counts
from distill.data.pack import pack_dataset, pack_rows
from distill.data.shift import shift_flat, shift_labels
from distill.losses import linear_divergence
from distill.models.causal_lm import final_hidden_states, lm_head, load_causal_lm
from distill.training.normalization import token_weights
from tests.fixtures import data_from


def _examples(n, max_len, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(2, max_len)
        ids = [rng.randint(5, 40) for _ in range(k)]
        labels = [t if rng.random() < 0.6 else -100 for t in ids]
        out.append({"input_ids": ids, "labels": labels, "example_id": f"ex{i}"})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_keep_every_token_in_order_and_restart_positions(seed):
    max_length = 24
    exs = _examples(37, max_length, seed)
    ds = datasets.Dataset.from_list(exs)
    packed = pack_dataset(ds, max_length, batch_size=10)
    rows = packed.to_list()
    assert len(rows) < len(exs)
    flat = [t for r in rows for t in r["input_ids"]]
    assert flat == [t for e in exs for t in e["input_ids"]]
    assert [t for r in rows for t in r["labels"]] == [t for e in exs for t in e["labels"]]
    assert [i for r in rows for i in r["example_ids"]] == [e["example_id"] for e in exs]
    k = 0
    for r in rows:
        assert len(r["input_ids"]) <= max_length
        expect = [p for i in r["example_ids"] for p in range(len(exs[int(i[2:])]["input_ids"]))]
        assert r["position_ids"] == expect
        k += len(r["example_ids"])
    # next fit within each map batch of 10: a row closes only when the next one won't fit
    for a, b in zip(rows, rows[1:]):
        first_next = int(b["example_ids"][0][2:])
        if first_next % 10:
            assert len(a["input_ids"]) + len(exs[first_next]["input_ids"]) > max_length


def test_too_long_example_is_refused():
    with pytest.raises(ValueError, match="longer than the packed row"):
        pack_rows({"input_ids": [[1] * 9], "labels": [[1] * 9]}, max_length=8)


def test_collator_pads_a_packed_row_as_its_own_document():
    rows = pack_rows({"input_ids": [[5, 6, 7], [8, 9], [10, 11, 12, 13]],
                      "labels": [[5, 6, 7], [8, 9], [10, 11, 12, 13]],
                      "example_id": ["a", "b", "c"]}, max_length=6)
    batch = PadCollator(pad_token_id=0)([{k: v[i] for k, v in rows.items()} for i in range(2)])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch["example_ids"] == [["a", "b"], ["c"]]
    masks = batch_masks(batch)
    # the position before each new document predicts nothing (nor does the padding)
    assert masks.real.tolist() == [[True, True, False, True], [True, True, True, False]]
    assert local_step_counts(masks).sequences == 3


@pytest.mark.parametrize("attn,flatten", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_row_equals_its_documents_alone(tiny_assets, monkeypatch, attn, flatten):
    """Hidden states, loss and student gradients of a packed batch equal the unpacked ones
    (the same documents, one per row, padded), under the valid_tokens policy. `flatten`
    takes the flash-attention route (the batch as one (1, B * T) row) on sdpa."""
    if flatten:
        monkeypatch.setattr("distill.models.causal_lm.uses_flash_attention", lambda model: True)
    student = load_causal_lm(str(tiny_assets["student"]), dtype="float32",
                             attn_implementation=attn)
    teacher = load_causal_lm(str(tiny_assets["teacher"]), dtype="float32",
                             attn_implementation=attn)
    exs = _examples(5, 9, seed=3)
    unpacked = PadCollator(0)(exs)
    rows = pack_dataset(datasets.Dataset.from_list(exs), 20).to_list()
    assert len(rows) < len(exs)
    packed = PadCollator(0)(rows)

    def run(batch):
        student.zero_grad()
        masks = batch_masks(batch)
        w = token_weights("valid_tokens", masks, local_step_counts(masks)).flatten()
        args = (batch["input_ids"], batch["attention_mask"], batch.get("position_ids"))
        hs = final_hidden_states(student, *args)
        with torch.no_grad():
            ht = final_hidden_states(teacher, *args)
        loss = linear_divergence(shift_flat(hs), lm_head(student)[0],
                                 teacher_hidden=shift_flat(ht),
                                 teacher_weight=lm_head(teacher)[0],
                                 labels=shift_labels(batch["labels"]), weights=w,
                                 kind="jsd", ce_weight=0.3)
        loss.backward()
        return hs.detach(), loss.detach(), [p.grad.clone() for p in student.parameters()]

    h_u, loss_u, g_u = run(unpacked)
    h_p, loss_p, g_p = run(packed)
    k = 0
    for r, row in enumerate(rows):  # each document's hidden states, wherever it sits
        start = 0
        for _ in row["example_ids"]:
            n = len(exs[k]["input_ids"])
            torch.testing.assert_close(h_p[r, start:start + n], h_u[k, :n], rtol=1e-5, atol=1e-5)
            start += n
            k += 1
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_p, g_u):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_packing_trains_end_to_end(compose_cfg, monkeypatch):
    """A packed mix (SFT and CPT documents) trains; its first step's loss is the loss of
    each document alone through the models' own forward (tests/step_check.py)."""
    from distill.models.causal_lm import load_tokenizer
    from distill.train import train
    from tests.step_check import assert_first_step_loss, record_first_step

    cfg = compose_cfg("+experiment=mix_jsd", "data.packing=true", "trainer.max_steps=4")
    dm = data_from(cfg, load_tokenizer(cfg.teacher.name_or_path))
    dm.setup("fit")
    assert "position_ids" in dm.train_set.column_names
    plain = data_from(cfg, dm.tokenizer, packing=False)
    plain.setup("fit")
    assert len(dm.train_set) < len(plain.train_set)
    assert sum(map(len, dm.train_set["input_ids"])) == sum(map(len, plain.train_set["input_ids"]))
    first = record_first_step(monkeypatch)
    summary = train(cfg)
    assert summary["global_step"] == 4
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["metrics"].values())
    assert all("position_ids" in b for b in first.batches)
    assert any(len(ids) > 1 for b in first.batches for ids in b["example_ids"])
    assert_first_step_loss(first, cfg.loss)


def test_packing_needs_a_transformers_that_masks_documents(monkeypatch):
    import transformers.masking_utils

    from distill.data.datamodule import check_packing_support

    check_packing_support()
    monkeypatch.delattr(transformers.masking_utils, "find_packed_sequence_indices")
    with pytest.raises(RuntimeError, match="upgrade transformers or set data.packing=false"):
        check_packing_support()
