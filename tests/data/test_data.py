"""Tokenization (assistant-only labels), padding, sources and the SFT + CPT mix."""

import json

import torch

from distill.data import DistillDataModule, PadCollator
from distill.data.chat import ChatEncoder
from distill.data.tokenize import cpt_ids, cpt_windows
from distill.models import load_tokenizer


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
