"""Data that used to give raw errors naming no file, row or field, or to train on something
no one meant: each now reads or is refused, naming the source, the file, the row and the
field (issue 18's list)."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest

from distill.data import DistillDataModule
from distill.data.rows import DataError
from distill.data.sources import load_source, open_sources
from tests.data.templates import CHATML, make_chat_tokenizer

Q = {"role": "user", "content": "2+2?"}
A = {"role": "assistant", "content": "4"}
OK = {"messages": [Q, A]}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)


def write(path, rows=(), raw: bytes | None = None):
    path.write_bytes(raw if raw is not None else
                     "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path


def data(tok, path, kind="sft", **kw):
    dm = DistillDataModule(tok, train=[{"name": "d", "kind": kind, "path": str(path)}], **kw)
    dm.setup("fit")
    return dm


def trained(tok, ex) -> str:
    return "".join(tok.convert_ids_to_tokens([t for t in ex["labels"] if t != -100]))


@pytest.mark.parametrize("suffix,kind", [(".jsonl", "sft"), (".txt", "cpt")])
def test_invalid_utf8_names_the_line_and_the_byte(chatml, tmp_path, suffix, kind):
    good = (json.dumps(OK) if suffix == ".jsonl" else "some text").encode()
    bad = good.replace(b"2+2" if suffix == ".jsonl" else b"some", b"s\xffme")
    path = write(tmp_path / f"d{suffix}", raw=good + b"\n" + good + b"\n" + bad + b"\n")
    with pytest.raises(ValueError, match=rf"data source 'd': line 3 of .*d{suffix} is not valid "
                                         r"UTF-8 \(byte b'\\xff' at column \d+\): save the file"):
        data(chatml, path, kind)


def test_openai_content_parts_are_joined_and_an_image_part_is_refused(chatml, tmp_path):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+"},
                                                       {"type": "text", "text": "2?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}
    [ex] = data(chatml, write(tmp_path / "p.jsonl", [parts])).train_set
    [plain] = data(chatml, write(tmp_path / "s.jsonl", [OK])).train_set
    assert ex["input_ids"] == plain["input_ids"] and trained(chatml, ex) == "4<|im_end|>"
    # strings and parts in one column: datasets would read the string "4" as the number 4
    mixed = data(chatml, write(tmp_path / "m.jsonl", [OK, parts])).train_set
    assert [e["input_ids"] for e in mixed] == [plain["input_ids"]] * 2
    image = {"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, A]}
    with pytest.raises(DataError, match=r"row 2 \(line 2 of .*i.jsonl\): messages\[0\]."
                                        r"content\[0\] is a 'image' part"):
        data(chatml, write(tmp_path / "i.jsonl", [OK, image]))


def test_mixed_content_types_read_exactly_where_datasets_refuses_them(chatml, tmp_path,
                                                                    monkeypatch):
    """Older datasets (before its Json feature) refuse a column of strings and lists."""
    import pyarrow as pa

    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}, A]}
    path = write(tmp_path / "old.jsonl", [OK, parts])

    def refuse(*args, **kwargs):
        raise pa.ArrowInvalid("JSON parse error: Column(/messages/[]/content) changed from "
                              "string to array in row 1")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    [a, b] = data(chatml, path).train_set
    assert a["input_ids"] == b["input_ids"] and trained(chatml, a) == "4<|im_end|>"


def test_integer_content_is_refused_naming_row_and_field(chatml, tmp_path):
    rows = [OK, {"messages": [Q, {"role": "assistant", "content": 4}]}]
    with pytest.raises(DataError, match=r"data source 'd', row 2 \(line 2 of .*\): messages\[1\]"
                                        r".content must be a string .*got int 4; write it as "
                                        r"a string \(\"4\"\)"):
        data(chatml, write(tmp_path / "n.jsonl", rows))


@pytest.mark.parametrize("role,meant", [("human", "user"), ("gpt", "assistant"),
                                        ("User", "user"), ("Assistant", "assistant")])
def test_roles_written_another_way_are_refused_with_the_role_to_write(chatml, tmp_path, role,
                                                                      meant):
    other = {"role": role, "content": "x"}
    rows = [OK, {"messages": [Q, other] if meant == "assistant" else [other, A]}]
    k = 1 if meant == "assistant" else 0
    with pytest.raises(DataError, match=rf"row 2 \(line 2 .*\): messages\[{k}\].role is "
                                        rf"'{role}'.*write '{meant}'"):
        data(chatml, write(tmp_path / "r.jsonl", rows))


def test_no_assistant_turn_names_the_roles_found(chatml, tmp_path):
    rows = [{"messages": [Q, {"role": "narrator", "content": "x"}]}] * 3
    with pytest.raises(ValueError, match=r"none of its 3 rows has an assistant turn \(role "
                                         r"'assistant'\) \(the roles found: narrator, user\)"):
        data(chatml, write(tmp_path / "x.jsonl", rows))


TOOLS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
         "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool>{{ c['function']['name'] }}"
         "</tool>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_calls_under_a_template_without_tool_support_are_refused(chatml, tmp_path):
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    rows = [OK, {"messages": [Q, call, {"role": "tool", "content": "4"}, A]}]
    path = write(tmp_path / "t.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 2 \(line 2 of .*t.jsonl\): its message 1 \(from "
                                         r"0\) has tool_calls, but the chat template never "
                                         r"renders tool calls"):
        data(chatml, path)
    ds = data(chatml, path, chat_template=TOOLS).train_set  # a template that renders them
    assert "<tool>add</tool>" in trained(chatml, ds[1]).replace("Ġ", " ")


def test_a_compressed_jsonl_file_reads_and_its_errors_name_the_line(chatml, tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(OK) + "\n" + json.dumps({"messages": [Q, {"role": "gpt"}]}) + "\n")
    with pytest.raises(DataError, match=r"row 2 \(line 2 of .*d.jsonl.gz\): messages\[1\]"):
        data(chatml, path)
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(OK) + "\n")
    assert len(data(chatml, path).train_set) == 1


def test_a_save_to_disk_folder_is_read_with_load_from_disk(chatml, tmp_path):
    ds = datasets.Dataset.from_list([OK, OK])
    ds.save_to_disk(str(tmp_path / "one"))
    assert len(data(chatml, tmp_path / "one").train_set) == 2
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_source({"name": "dd", "path": str(tmp_path / "dd"), "split": "test"})) == 1
    with pytest.raises(ValueError, match=r"the saved DatasetDict .*dd has no split 'val' \(it "
                                         r"has \['test', 'train'\]\)"):
        load_source({"name": "dd", "path": str(tmp_path / "dd"), "split": "val"})


def test_local_paths_that_are_not_data_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data source 'm': no file or folder .*/nope"):
        load_source({"name": "m", "path": str(tmp_path / "nope")})
    (tmp_path / "d.tsv").write_text("a\tb\n")
    with pytest.raises(ValueError, match=r"d.tsv is a .tsv file; distill reads .*\.jsonl.*"
                                         r"optionally compressed \(.gz"):
        load_source({"name": "t", "path": str(tmp_path / "d.tsv")})


def test_sources_are_opened_and_their_first_rows_checked_without_a_tokenizer(tmp_path):
    from distill.core.rules import parse
    from distill.data.config import DataConfig

    path = write(tmp_path / "d.jsonl", [OK, {"messages": [Q, {"role": "gpt", "content": "4"}]}])
    cfg = parse(DataConfig, {"train": [{"name": "d", "path": str(path)}]}, "data.")
    with pytest.raises(DataError, match=r"row 2 .*messages\[1\].role is 'gpt'"):
        open_sources(cfg)


def test_sources_named_alike_get_example_ids_of_their_own(chatml, tmp_path):
    """The README's example named train and val `mine` alike: their examples shared ids, and
    the teacher cache's index mixed them (`tokens of example 'mine:0' differs`). A val source
    named like a train one now gets ids of its own; two of one split are refused."""
    from distill.core.rules import ConfigError

    a, b = write(tmp_path / "a.jsonl", [OK]), write(tmp_path / "b.jsonl", [OK, OK])
    dm = DistillDataModule(chatml, train=[{"name": "mine", "path": str(a)}],
                           val=[{"name": "mine", "path": str(b)}])
    dm.setup("fit")
    assert dm.train_set["example_id"] == ["mine:0"]
    assert dm.val_set["example_id"] == ["mine@val:0", "mine@val:1"]
    with pytest.raises(ConfigError, match=r"data.train\[0\] and data.train\[1\] are both named "
                                          r"'mine': each source needs a name of its own"):
        DistillDataModule(chatml, train=[{"name": "mine", "path": str(a)},
                                         {"name": "mine", "path": str(b)}])
    with pytest.raises(ConfigError, match=r"data.val\[0\] and data.val\[1\] are both named"):
        DistillDataModule(chatml, train=[{"path": str(a)}], val=[{"path": str(b)},
                                                                 {"path": str(b)}])
