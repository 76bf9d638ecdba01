"""SFT rows through the DataModule: row formats, and errors that name the source, the row
(its line in the jsonl file) and the field."""

import json
import logging

import pytest

from distill.data import DistillDataModule
from tests.data.templates import CHATML, make_chat_tokenizer

Q = {"role": "user", "content": "2+2?"}
A = {"role": "assistant", "content": "4"}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)


def setup(tok, tmp_path, rows=None, lines=None, suffix=".jsonl", **kw):
    path = tmp_path / f"d{suffix}"
    path.write_text("".join(lines) if lines is not None else
                    "".join(json.dumps(r) + "\n" for r in rows))
    dm = DistillDataModule(tok, train=[{"name": "d", "kind": "sft", "path": str(path)}], **kw)
    dm.setup("fit")
    return dm


def trained_text(tok, ex):
    return "".join(tok.convert_ids_to_tokens([t for t in ex["labels"] if t != -100]))


def test_prompt_completion_rows_strings_and_message_lists(chatml, tmp_path):
    [first] = setup(chatml, tmp_path, [{"prompt": "2+2?", "completion": "4"}]).train_set
    [second] = setup(chatml, tmp_path, [
        {"prompt": [{"role": "system", "content": "Be brief."}, Q],
         "completion": [{"role": "assistant", "content": "four"}]}]).train_set
    assert trained_text(chatml, first) == "4<|im_end|>"
    assert "".join(chatml.convert_ids_to_tokens(first["input_ids"])).startswith(
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>")
    assert trained_text(chatml, second) == "four<|im_end|>"
    assert "Be brief." in "".join(chatml.convert_ids_to_tokens(second["input_ids"]))


@pytest.mark.parametrize("lines,match", [
    (['{"messages": [{"role": "user", "content": "a"}]}\n', "\n", '{"messages": [\n'],
     r"data source 'd': line 3 of .*d.jsonl is not valid JSON"),
    ([json.dumps({"messages": [Q, A]}) + "\n", json.dumps({"other": 1}) + "\n"],
     r"data source 'd', row 2 \(line 2 of .*d.jsonl\): field 'messages' is missing or null"),
    ([json.dumps({"messages": [Q, {"role": "assistant", "content": None}]}) + "\n"],
     r"row 1 \(line 1 of .*\): messages\[1\].content is missing or null \(role 'assistant'\)"),
    ([json.dumps({"messages": [Q, A]}) + "\n", "\n",
      json.dumps({"messages": [{"content": "x"}, A]}) + "\n"],
     r"row 2 \(line 3 of .*\): messages\[0\] has no `role`"),
    ([json.dumps({"messages": [Q, A]}) + "\n", json.dumps({"messages": []}) + "\n"],
     r"row 2 \(line 2 of .*\): field 'messages' is an empty conversation"),
    ([json.dumps({"messages": [{"from": "human", "value": "hi"}]}) + "\n"],
     r"messages\[0\] has no `role` .*; it has `from`/`value`, the ShareGPT format"),
    ([json.dumps({"messages": "hi"}) + "\n"],
     r"row 1 .*field 'messages' is a string; it must be a list of \{role, content\}"),
])
def test_bad_rows_name_source_row_and_field(chatml, tmp_path, lines, match):
    with pytest.raises(ValueError, match=match):
        setup(chatml, tmp_path, lines=lines)


def test_malformed_json_file(chatml, tmp_path):
    with pytest.raises(ValueError, match=r"d.json is not valid JSON at line 2, column \d+"):
        setup(chatml, tmp_path, lines=['[{"messages": []},\n', '{"messages": ]\n'],
              suffix=".json")


def test_no_assistant_turn_is_not_blamed_on_the_template(chatml, tmp_path, caplog):
    rows = [{"messages": [Q, {"role": "user", "content": "x"}]}] * 3
    with pytest.raises(ValueError, match="none of its 3 rows has an assistant turn") as err:
        setup(chatml, tmp_path, rows)
    assert "template" not in str(err.value) and "kind: prompts" in str(err.value)
    with caplog.at_level(logging.INFO, logger="distill.data.tokenize"):
        dm = setup(chatml, tmp_path, rows + [{"messages": [Q, A]}])
    assert dm.train_set["example_id"] == ["d:3"]
    assert "4 rows -> 1 examples; dropped: 3 rows without an assistant turn" in caplog.text


def test_max_length_too_short_for_the_prompts(chatml, tmp_path):
    rows = [{"messages": [Q, A]}] * 2
    frame = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    prompt = len(chatml(frame + "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match=r"data.max_length=5 is too short for the prompts of "
                       r"data source 'd': no assistant token fits \(the shortest example needs "
                       rf"max_length >= {prompt + 1}\); raise data.max_length"):
        setup(chatml, tmp_path, rows, max_length=5)
    for bad in (0, 1, -1):
        with pytest.raises(ValueError, match=rf"data.max_length={bad}: must be an integer >= 2 "
                                             r"\(tokens per row: room for a token and its "
                                             r"next\)"):
            setup(chatml, tmp_path, rows, max_length=bad)


def test_truncation_is_logged_and_keeps_the_start(chatml, tmp_path, caplog):
    rows = [{"messages": [Q, {"role": "assistant", "content": "x" * 50}]}, {"messages": [Q, A]}]
    full = setup(chatml, tmp_path, rows).train_set.to_list()
    limit = len(full[0]["input_ids"]) - 20
    with caplog.at_level(logging.INFO, logger="distill.data.tokenize"):
        cut = setup(chatml, tmp_path, rows, max_length=limit).train_set.to_list()
    assert cut[0]["input_ids"] == full[0]["input_ids"][:limit]
    assert cut[0]["labels"] == full[0]["labels"][:limit]
    assert cut[1] == full[1]
    assert (f"2 rows -> 2 examples; 1 truncated to max_length={limit} (20 tokens cut)"
            in caplog.text)


def test_empty_file_and_kind_errors(chatml, tmp_path):
    with pytest.raises(ValueError, match="data source 'd' .*d.jsonl. is empty"):
        setup(chatml, tmp_path, lines=["\n\n"])
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"messages": [Q, A]}) + "\n")
    with pytest.raises(ValueError, match=r"data.train\[0\].kind='chat' \(source 'x'\): must be "
                       "one of sft, cpt, prompts"):
        DistillDataModule(chatml, train=[{"name": "x", "kind": "chat", "path": str(path)}])
    with pytest.raises(ValueError, match="data.assistant_turns='every': must be one of all, last"):
        DistillDataModule(chatml, train=[{"path": str(path)}], assistant_turns="every")


def test_tokenizing_in_processes_gives_the_same_examples(chatml, tmp_path):
    rows = [{"messages": [Q, {"role": "assistant", "content": str(k)}]} for k in range(6)]
    one = setup(chatml, tmp_path, rows).train_set.to_list()
    two = setup(chatml, tmp_path, rows, num_proc=2).train_set.to_list()
    assert one == two and len(one) == 6


def test_a_row_of_a_file_only_datasets_can_decompress_is_named_by_its_row(tmp_path):
    """where() counts lines only in files it can open itself: a jsonl.lz4 or .zst row is
    named by its row (it used to read the compressed bytes as text and fail)."""
    import gzip

    from distill.data.files import where

    for suffix in (".lz4", ".zst"):
        path = tmp_path / f"rows.jsonl{suffix}"
        path.write_bytes(bytes(range(128, 256)))  # not UTF-8, as compressed data is not
        assert where({"name": "x", "path": str(path)}, 2) == "data source 'x', row 3"
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"a": 1}\n\n{"a": 2}\n{"a": 3}\n')
    got = where({"name": "x", "path": str(path)}, 2)
    assert got == f"data source 'x', row 3 (line 4 of {path})"
