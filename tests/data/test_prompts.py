"""`kind: prompts` sources (on-policy distillation): the prompt with the generation prompt,
every label -100, never refused for having no trained token."""

import json
import logging

import pytest

from distill.data import DistillDataModule
from tests.data.templates import CHATML, make_chat_tokenizer

SYSTEM = "<|im_start|>system\nYou are helpful.<|im_end|>\n"


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _text(tok, ids):
    return "".join(tok.convert_ids_to_tokens(ids))


def test_prompt_rows_end_with_the_generation_prompt_and_train_nothing(chatml, tmp_path):
    rows = [{"prompt": "hi"},
            {"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "2+2?"}]}]
    msgs = [{"messages": [{"role": "user", "content": "a"}]},
            {"messages": [{"role": "user", "content": "b"},
                          {"role": "assistant", "content": "dropped"}]}]
    dm = DistillDataModule(chatml, train=[
        {"name": "p", "kind": "prompts", "path": _write(tmp_path / "p.jsonl", rows)}],
        val=[{"name": "m", "kind": "prompts", "path": _write(tmp_path / "m.jsonl", msgs)}],
        batch_size=4, shuffle=False)
    dm.setup("fit")
    got = {ex["example_id"]: ex for ex in dm.train_set.to_list() + dm.val_set.to_list()}
    assert sorted(got) == ["m:0", "m:1", "p:0", "p:1"]
    gen = "<|im_start|>assistant\n"
    user = "<|im_start|>user\n{}<|im_end|>\n"
    assert _text(chatml, got["p:0"]["input_ids"]) == SYSTEM + user.format("hi") + gen
    assert _text(chatml, got["p:1"]["input_ids"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" + gen)
    # a conversation that ends with an assistant turn loses it: the student writes it
    assert _text(chatml, got["m:1"]["input_ids"]) == SYSTEM + user.format("b") + gen
    for ex in got.values():
        assert ex["labels"] == [-100] * len(ex["input_ids"])
    batch = next(iter(dm.train_dataloader()))
    assert (batch["labels"] == -100).all() and batch["example_id"] == ["p:0", "p:1"]


def test_prompts_longer_than_max_length_are_dropped_and_counted(chatml, tmp_path, caplog):
    rows = [{"prompt": "x" * 5}, {"prompt": "x" * 40}, {"prompt": "y"}]
    path = _write(tmp_path / "p.jsonl", rows)
    frame = SYSTEM + "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    base = len(chatml(frame, add_special_tokens=False)["input_ids"])
    limit = base + 20  # the 40-character prompt does not fit, the others do
    dm = DistillDataModule(chatml, train=[{"name": "p", "kind": "prompts", "path": path}],
                           max_length=limit)
    with caplog.at_level(logging.INFO, logger="distill.data.tokenize"):
        dm.setup("fit")
    assert dm.train_set["example_id"] == ["p:0", "p:2"]
    assert "3 rows -> 2 examples; dropped: 1 prompts longer than max_length" in caplog.text
    dm = DistillDataModule(chatml, train=[{"name": "p", "kind": "prompts", "path": path}],
                           max_length=20)
    with pytest.raises(ValueError, match=f"max_length=20 is too short for the prompts of "
                       f"data source 'p': every prompt is longer .the shortest example needs "
                       f"max_length >= {base + 1}"):
        dm.setup("fit")


def test_a_prompts_source_needs_a_prompt(chatml, tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"text": "hi"}])
    dm = DistillDataModule(chatml, train=[{"name": "p", "kind": "prompts", "path": path}])
    with pytest.raises(ValueError, match="has no column 'prompt' or 'messages'"):
        dm.setup("fit")
    path = _write(tmp_path / "q.jsonl", [{"messages": [{"role": "assistant", "content": "a"}]}])
    dm = DistillDataModule(chatml, train=[{"name": "q", "kind": "prompts", "path": path}])
    with pytest.raises(ValueError, match=r"row 1 \(line 1 of .*q.jsonl\): field 'messages' "
                                         "holds no prompt"):
        dm.setup("fit")


def test_config_validator_knows_the_data_keys(compose_cfg):
    from distill.run.config import problems

    ok = compose_cfg("+experiment=sft_rkl", "data.assistant_turns=last", "data.cpt_stride=64",
                     "data.train=[{name: p, kind: prompts, path: x.jsonl}]")
    assert problems(ok) == []
    bad = compose_cfg("+experiment=sft_rkl", "data.assistant_turns=first", "data.cpt_stride=0",
                      "data.train=[{name: p, kind: chat, path: x.jsonl}]")
    found = "\n".join(problems(bad))
    assert "data.assistant_turns='first': must be one of all, last" in found
    assert "data.cpt_stride=0: must be an integer >= 1 or null" in found
    assert "data.train[0].kind='chat' (source 'p'): must be one of sft, cpt, prompts" in found
