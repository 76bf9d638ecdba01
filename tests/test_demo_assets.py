"""The bundled demo: tokenizer and chat template, held-out data, trained teacher, student."""

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import distill
from distill.demo.evaluation import generate_answers, load_examples, task_accuracy

ASSETS = Path(distill.__file__).parent / "demo" / "assets"
DATA = ASSETS / "data"
# The committed teacher scores 0.96 on the full test split (addition 0.91, reversal 1.0,
# sorting 0.97); the subset below leaves room for the subset's noise, not for a broken model.
TEACHER_MIN_ACCURACY = 0.85


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizer")


def _marked_tokens(tokenizer, messages):
    enc = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    return tokens, enc["assistant_masks"]


def test_chat_template_renders_the_documented_format(tokenizer):
    chat = [{"role": "user", "content": "add 12+30"}, {"role": "assistant", "content": "42"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        "<s><|user|>add 12+30<|assistant|>42</s>"
    )
    assert tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True) == (
        "<s><|user|>add 12+30<|assistant|>"
    )


def test_assistant_mask_marks_exactly_the_answers_and_their_eos(tokenizer):
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 12+30"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "reverse abc"},
        {"role": "assistant", "content": "cba"},
    ]
    tokens, mask = _marked_tokens(tokenizer, chat)
    assert [t for t, m in zip(tokens, mask) if m] == ["4", "2", "</s>", "c", "b", "a", "</s>"]
    # The marked tokens are the ones right after each <|assistant|>, nothing else.
    starts = [i + 1 for i, t in enumerate(tokens) if t == "<|assistant|>"]
    expected = [0] * len(tokens)
    for start, length in zip(starts, [3, 4]):
        expected[start : start + length] = [1] * length
    assert mask == expected


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.pad_token_id == 0
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    for token in ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    # Plain text (CPT) gets a bos and round-trips character for character.
    text = "ada had 3 pens and found 4 more, so ada has 7 pens."
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def _reference_answer(example):
    prompt = example["messages"][0]["content"]
    verb, arg = prompt.split(" ")
    if verb == "add":
        a, b = arg.split("+")
        return str(int(a) + int(b))
    return arg[::-1] if verb == "reverse" else "".join(sorted(arg))


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_sft_answers_are_correct_and_tasks_balanced(split):
    examples = load_examples(DATA / f"sft_{split}.jsonl")
    assert len(examples) >= (20000 if split == "train" else 200)
    assert all(ex["messages"][-1]["content"] == _reference_answer(ex) for ex in examples)
    tasks = ["addition", "reversal", "sorting"]
    counts = {t: sum(ex["task"] == t for ex in examples) for t in tasks}
    assert min(counts.values()) >= len(examples) // 4, counts


def test_held_out_splits_never_appear_in_train():
    prompts = {
        split: {ex["messages"][0]["content"] for ex in load_examples(DATA / f"sft_{split}.jsonl")}
        for split in ["train", "val", "test"]
    }
    assert not prompts["test"] & prompts["train"]
    assert not prompts["val"] & prompts["train"]
    assert not prompts["val"] & prompts["test"]


def test_cpt_corpus_is_one_document_per_line():
    for split in ["train", "val"]:
        lines = (DATA / f"cpt_{split}.txt").read_text(encoding="utf-8").splitlines()
        assert len(lines) >= 200 and all(line.strip() for line in lines)


def test_teacher_loads_and_solves_held_out_tasks(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(ASSETS / "teacher")
    assert AutoTokenizer.from_pretrained(ASSETS / "teacher").get_vocab() == tokenizer.get_vocab()
    result = task_accuracy(model, tokenizer, load_examples(DATA / "sft_test.jsonl", limit=90))
    assert result["overall"] >= TEACHER_MIN_ACCURACY, result


def test_student_is_smaller_and_shares_the_vocabulary(tokenizer):
    student = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS / "student"))
    teacher = json.loads((ASSETS / "teacher" / "config.json").read_text())
    assert student.config.vocab_size == teacher["vocab_size"] == len(tokenizer)
    assert student.config.hidden_size < teacher["hidden_size"]
    n_teacher = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(ASSETS / "teacher")
    ).num_parameters()
    assert student.num_parameters() * 3 < n_teacher
    assert AutoTokenizer.from_pretrained(ASSETS / "student").get_vocab() == tokenizer.get_vocab()


def test_assets_fit_the_package_budget():
    size = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert size <= 15 * 2**20, f"demo assets are {size / 2**20:.1f} MiB"


def _preferred_order(letters):
    small = sorted(letters)[: (len(letters) + 1) // 2]
    return "".join(small) + "".join(c for c in reversed(letters) if c not in small)


def test_the_distillation_demo_is_the_graded_permutation_task():
    """tasks_*.jsonl (conf/data/tasks_demo.yaml): distinct letters to write in any order; the
    test split stores the teacher's preferred order and is scored by `match: permutation`;
    the labelled and val answers are orderings of their letters; no prompt is shared."""
    splits = {s: [json.loads(line) for line in (DATA / f"tasks_{s}.jsonl").open()]
              for s in ["labeled", "prompts", "val", "test"]}
    assert [len(splits[s]) for s in splits] == [128, 20000, 201, 201]
    for split, examples in splits.items():
        for ex in examples:
            verb, letters = ex["messages"][0]["content"].split(" ")
            assert verb == "permute" and ex["task"] == "permutation"
            assert 7 <= len(letters) <= 12 and len(set(letters)) == len(letters)
            if split == "prompts":
                assert len(ex["messages"]) == 1
            else:
                assert sorted(ex["messages"][-1]["content"]) == sorted(letters)
            if split == "test":
                assert ex["match"] == "permutation"
                assert ex["messages"][-1]["content"] == _preferred_order(letters)
    prompts = {s: {ex["messages"][0]["content"] for ex in v} for s, v in splits.items()}
    train = prompts["labeled"] | prompts["prompts"]
    assert not (prompts["test"] & train) and not (prompts["val"] & train)
    assert not prompts["val"] & prompts["test"]


def test_teacher_writes_valid_permutations_in_its_style_or_alphabetical_order(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(ASSETS / "teacher")
    examples = load_examples(DATA / "tasks_test.jsonl", limit=60)
    result = task_accuracy(model, tokenizer, examples, max_new_tokens=14)
    assert result["overall"] >= 0.95, result  # the committed teacher: 0.995 on all 201
    answers = generate_answers(model, tokenizer, examples, 14, 64)
    styles = [("preferred" if a.strip() == ex["messages"][-1]["content"] else
               "alphabetical" if a.strip() == "".join(sorted(a.strip())) else "other")
              for a, ex in zip(answers, examples)]
    # greedily it writes its own style or alphabetical order (57% and 39% of all 201)
    assert styles.count("preferred") >= 0.3 * len(styles), styles
    assert styles.count("alphabetical") >= 0.3 * len(styles), styles
    assert styles.count("other") <= 0.05 * len(styles), styles


def test_the_demo_data_is_what_the_asset_script_writes(tmp_path):
    """`scripts/make_demo_assets.py --demo-tasks-only` rebuilds tasks_*.jsonl byte for byte."""
    from tests.fixtures import load_script

    script = load_script("scripts/make_demo_assets.py")
    script.main(["--out", str(tmp_path), "--demo-tasks-only"])
    for split in ["labeled", "prompts", "val", "test"]:
        name = f"tasks_{split}.jsonl"
        assert (tmp_path / "data" / name).read_bytes() == (DATA / name).read_bytes(), name
