"""Tokenization (assistant-only labels), padding, sources and the SFT + CPT mix."""

import json

import torch

from distill.data import DistillDataModule, PadCollator
from distill.data.chat import ChatEncoder
from distill.data.tokenize import cpt_ids, cpt_windows
from distill.models.causal_lm import load_tokenizer


def test_sft_labels_only_assistant_tokens(tiny_assets):
    tok = load_tokenizer(str(tiny_assets["teacher"]))
    msgs = [{"role": "user", "content": "add 12+5=?"}, {"role": "assistant", "content": "17"}]
    [(ids, labels)] = ChatEncoder(tok).examples(msgs)
    out = {"input_ids": ids, "labels": labels}
    trained = [t for t in out["labels"] if t != -100]
    assert tok.convert_ids_to_tokens(trained) == ["1", "7", "<|end|>"]
    prompt_len = len(out["input_ids"]) - len(trained)
    assert out["labels"][:prompt_len] == [-100] * prompt_len
    assert out["labels"][prompt_len:] == out["input_ids"][prompt_len:]


def test_cpt_trains_every_token(tiny_assets):
    tok = load_tokenizer(str(tiny_assets["teacher"]))
    ids = cpt_ids("one two three", tok)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert len(ids) == len("one two three") + 2
    [(window, labels)] = cpt_windows(ids, max_length=len(ids))
    assert window == labels == ids


def test_pad_collator_right_pads_with_ignored_labels():
    batch = PadCollator(pad_token_id=0, pad_to_multiple_of=4)(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "example_id": "a:0"},
         {"input_ids": [8], "labels": [8], "example_id": "a:1"}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["example_id"] == ["a:0", "a:1"]


def test_mix_draws_from_both_sources(tiny_assets, tmp_path):
    tok = load_tokenizer(str(tiny_assets["teacher"]))
    sft = [{"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}] * 50
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (tmp_path / "c.txt").write_text("\n".join(["one two"] * 50) + "\n")
    dm = DistillDataModule(tok, train=[
        {"name": "s", "kind": "sft", "path": str(tmp_path / "s.jsonl"), "weight": 0.5},
        {"name": "c", "kind": "cpt", "path": str(tmp_path / "c.txt"), "weight": 0.5}],
        batch_size=8)
    dm.setup("fit")
    ids = [ex.split(":")[0] for ex in dm.train_set["example_id"]]
    assert ids.count("s") > 10 and ids.count("c") > 10
    batch = next(iter(dm.train_dataloader()))
    masked = (batch["labels"] == -100) & (batch["attention_mask"] == 1)
    assert masked.any()  # SFT prompts are masked, CPT rows are not
    assert torch.equal(batch["labels"][batch["labels"] != -100],
                       batch["input_ids"][batch["labels"] != -100])


def test_padded_widths_round_up_and_stop_at_the_cap():
    from distill.data.collate import CUDA_WIDTH_MULTIPLE, padded_width, width_multiple

    assert [padded_width(n, 64) for n in (1, 63, 64, 65, 2000)] == [64, 64, 64, 128, 2048]
    assert padded_width(2000, 64, cap=2010) == 2010  # never past max_length...
    assert padded_width(2020, 64, cap=2010) == 2020  # ...unless the row itself is longer
    assert padded_width(7, 1) == 7
    assert width_multiple(None, "cuda") == CUDA_WIDTH_MULTIPLE == 64
    assert width_multiple(None, "cpu") == 1 and width_multiple(8, "cuda") == 8
    batch = PadCollator(0, 4, cap=6)([{"input_ids": [5] * 5, "labels": [5] * 5}])
    assert batch["input_ids"].shape == (1, 6) and batch["attention_mask"].sum() == 5


def _rows_module(tok, tmp_path, **settings):
    rows = [{"messages": [{"role": "user", "content": "q" * n},
                          {"role": "assistant", "content": "a"}]} for n in range(1, 40)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = DistillDataModule(tok, train=[{"name": "s", "kind": "sft",
                                        "path": str(tmp_path / "s.jsonl")}],
                           batch_size=4, max_length=100, **settings)
    dm.setup("fit")
    return dm


def test_unpacked_widths_follow_the_device(tiny_assets, tmp_path):
    """data.pad_to_multiple_of=null: batches headed for a CUDA device are padded to a
    multiple of 64 (capped at max_length), elsewhere to their longest row; a set value is
    kept on every device; packed rows stay at max_length."""
    tok = load_tokenizer(str(tiny_assets["teacher"]))
    dm = _rows_module(tok, tmp_path)
    widths = [b["input_ids"].shape[1] for b in dm.train_dataloader()]
    longest = [int(b["attention_mask"].sum(1).max()) for b in dm.train_dataloader()]
    assert widths == longest and len(set(widths)) > 3  # on the CPU: exactly the longest
    dm.for_device("cuda")
    for b in dm.train_dataloader():
        n = int(b["attention_mask"].sum(1).max())
        assert b["input_ids"].shape[1] == min(-(-n // 64) * 64, 100)
        assert (b["labels"][b["attention_mask"] == 0] == -100).all()
    fixed = _rows_module(tok, tmp_path, pad_to_multiple_of=8)
    fixed.for_device("cuda")
    assert all(b["input_ids"].shape[1] % 8 == 0 for b in fixed.train_dataloader())
    packed = _rows_module(tok, tmp_path, packing=True)
    packed.for_device("cuda")
    assert {b["input_ids"].shape[1] for b in packed.train_dataloader()} == {100}


def test_setup_inside_a_trainer_pads_for_its_device(tiny_assets, tmp_path):
    from types import SimpleNamespace

    tok = load_tokenizer(str(tiny_assets["teacher"]))
    dm = _rows_module(tok, tmp_path)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda")))
    dm.setup("fit")  # what Lightning calls once the trainer is attached
    assert dm.padding.multiple == 64
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    dm.setup("fit")
    assert dm.padding.multiple == 1


def test_a_cached_teachers_collate_pads_for_the_device_too(tiny_assets, tmp_path):
    """A cached teacher wraps the collate (its targets read in the loader); the width rule
    must still reach the padding inside it."""
    from distill.training.teachers import TargetsCollate

    class NoCache:
        def batch_targets(self, batch):
            return batch["input_ids"] * 0, batch["input_ids"] * 0.0

    tok = load_tokenizer(str(tiny_assets["teacher"]))
    dm = _rows_module(tok, tmp_path)
    dm.collate = TargetsCollate(dm.collate, NoCache())  # what CachedTeacher.prefetch_in does
    dm.for_device("cuda")
    for b in dm.train_dataloader():
        n = int(b["attention_mask"].sum(1).max())
        assert b["input_ids"].shape[1] == min(-(-n // 64) * 64, 100) > 0
        assert b["target_ids"].shape == b["input_ids"].shape
