"""Assistant-only labels for chat templates in the style of ChatML, Llama-3, Mistral, Gemma,
a marked template and a Qwen3-style one that rewrites earlier turns.

The trained positions are decoded token by token (the fixture's tokenizer is one character
per token) and compared with the assistant texts written out here, end-of-turn token
included: an oracle that does not go through the code under test.
"""

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from distill.data.chat import ChatEncoder, TemplateError
from tests.data.templates import (
    CHATML,
    MISTRAL_LAST_SYSTEM,
    QWEN3,
    TEMPLATES,
    make_chat_tokenizer,
)

LEAD = {"mistral": " "}  # Mistral's answer starts with the space after [/INST]
TURNS = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4."}]
SYSTEM = [{"role": "system", "content": "Be brief."}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    out = {name: make_chat_tokenizer(root / name, tpl, bos)
           for name, (tpl, bos, _) in TEMPLATES.items()}
    out["qwen3"] = make_chat_tokenizer(root / "qwen3", QWEN3)
    return out


def trained_runs(tok, ids, labels):
    """Maximal runs of trained positions, decoded; labels must equal the ids there."""
    runs, current = [], None
    for t, y in zip(ids, labels):
        if y == -100:
            current = None
            continue
        assert y == t
        if current is None:
            current = []
            runs.append(current)
        current.append(t)
    return ["".join(tok.convert_ids_to_tokens(r)) for r in runs]


def text(tok, ids):
    return "".join(tok.convert_ids_to_tokens(ids))


@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_assistant_turn_and_its_end_token_are_trained(tokenizers, name, system):
    tok, eot = tokenizers[name], TEMPLATES[name][2]
    messages = (SYSTEM if system else []) + TURNS
    [(ids, labels)] = ChatEncoder(tok).examples(messages)
    lead = LEAD.get(name, "")
    assert trained_runs(tok, ids, labels) == [lead + "Hello!" + eot, lead + "It is 4." + eot]
    # the example is the conversation as the template renders it, system turn included
    assert text(tok, ids) == tok.apply_chat_template(messages, tokenize=False)
    assert ("Be brief." in text(tok, ids)) == system
    assert labels[0] == -100


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_last_turn_only(tokenizers, name):
    tok, eot = tokenizers[name], TEMPLATES[name][2]
    [(ids, labels)] = ChatEncoder(tok, assistant_turns="last").examples(SYSTEM + TURNS)
    assert trained_runs(tok, ids, labels) == [LEAD.get(name, "") + "It is 4." + eot]
    assert "Hello!" in text(tok, ids)  # the earlier turn stays as context


def test_whitespace_after_the_end_of_turn_token_is_context_only(tokenizers):
    tok = tokenizers["chatml"]
    [(ids, labels)] = ChatEncoder(tok).examples(TURNS)
    assert text(tok, ids).endswith("It is 4.<|im_end|>\n")
    assert labels[-1] == -100 and tok.convert_ids_to_tokens(ids[-1]) == "\n"
    assert labels[-2] == tok.convert_tokens_to_ids("<|im_end|>")


def test_trailing_user_turn_is_not_part_of_the_example(tokenizers):
    tok = tokenizers["llama3"]
    [(ids, labels)] = ChatEncoder(tok).examples(TURNS + [{"role": "user", "content": "bye"}])
    assert trained_runs(tok, ids, labels) == ["Hello!<|eot_id|>", "It is 4.<|eot_id|>"]
    assert "bye" not in text(tok, ids)


def test_rewriting_template_gives_one_example_per_turn(tokenizers):
    """Qwen3-style: earlier turns lose their <think> block once a user turn follows, so each
    assistant turn is its own example, seen as the model sees it when writing it."""
    tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello!"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    enc = ChatEncoder(tok)
    first, second = enc.examples(messages)
    assert enc.rewrites
    assert trained_runs(tok, *first) == ["<think>\nsay hi\n</think>\n\nHello!<|im_end|>"]
    assert text(tok, first[0]) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                   "<think>\nsay hi\n</think>\n\nHello!<|im_end|>\n")
    assert trained_runs(tok, *second) == ["<think>\nadd\n</think>\n\n4<|im_end|>"]
    assert text(tok, second[0]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\nadd\n</think>\n\n4<|im_end|>\n")
    [last] = ChatEncoder(tok, assistant_turns="last").examples(messages)
    assert last == second
    one = ChatEncoder(tok)
    assert len(one.examples(messages[:2])) == 1 and not one.rewrites


def test_system_text_that_moves_to_the_last_user_turn(tokenizers, tmp_path):
    """Newer Mistral templates put the system text in the last user turn: adding a turn
    moves it, so each assistant turn is its own example, as the model saw it then."""
    tok = make_chat_tokenizer(tmp_path / "m", MISTRAL_LAST_SYSTEM, "<s>")
    enc = ChatEncoder(tok)
    first, second = enc.examples(SYSTEM + TURNS)
    assert enc.rewrites
    assert text(tok, first[0]) == "<s>[INST] Be brief.\n\nhi there [/INST] Hello!</s>"
    assert trained_runs(tok, *first) == [" Hello!</s>"]
    assert text(tok, second[0]) == ("<s>[INST] hi there [/INST] Hello!</s>"
                                    "[INST] Be brief.\n\n2+2? [/INST] It is 4.</s>")
    assert trained_runs(tok, *second) == [" It is 4.</s>"]
    [(ids, labels)] = ChatEncoder(tok).examples(TURNS)  # no system turn: nothing moves
    assert trained_runs(tok, ids, labels) == [" Hello!</s>", " It is 4.</s>"]


def test_template_kwargs_reach_the_template(tokenizers):
    """Qwen3 with enable_thinking=false: the generation prompt holds an empty <think> block,
    so only the answer and <|im_end|> are written by the model."""
    tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    enc = ChatEncoder(tok, template_kwargs={"enable_thinking": False})
    [(ids, labels)] = enc.examples(messages)
    assert trained_runs(tok, ids, labels) == ["Hello!<|im_end|>"]
    assert text(tok, enc.prompt(messages[:1])).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [(ids, labels)] = ChatEncoder(tok).examples(messages)
    assert trained_runs(tok, ids, labels) == ["<think>\n\n</think>\n\nHello!<|im_end|>"]


def test_template_that_is_not_prefix_stable_is_refused(tokenizers):
    broken = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>Assistant\n'")
    assert broken != CHATML
    with pytest.raises(TemplateError, match=r"not prefix-stable: the prompt it renders for "
                                            r"assistant turn 1 .* differ at character \d+"):
        ChatEncoder(tokenizers["chatml"], chat_template=broken).examples(TURNS)


def test_tokens_merged_across_the_generation_prompt(tmp_path, caplog):
    """A generation prompt that ends with a space, and a tokenizer whose words carry their
    leading space (" Hello"): the prompt's last token is not a token of the full text. Such
    a row is dropped and counted; a source where every row merges is refused."""
    import json
    import logging

    from distill.data import DistillDataModule

    words = ["<|im_start|>", "<|im_end|>", "<unk>", "<pad>", " ", "\n", "!", "user",
             "assistant", "hi", "Hello", " Hello", ":"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[A-Za-z]+|[\s\S]"), "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  additional_special_tokens=words[:2])
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(TemplateError, match="the tokenizer merges the end of the generation "
                                            "prompt with the start of assistant turn 1"):
        ChatEncoder(tok).examples(TURNS[:2])
    fine = [TURNS[0], {"role": "assistant", "content": "!"}]  # "!" is not merged with " "
    [(ids, labels)] = ChatEncoder(tok).examples(fine)
    assert trained_runs(tok, ids, labels) == ["!\n"]
    path = tmp_path / "m.jsonl"
    src = [{"name": "m", "kind": "sft", "path": str(path)}]
    path.write_text(json.dumps({"messages": TURNS[:2]}) + "\n" + json.dumps({"messages": fine}))
    with caplog.at_level(logging.INFO, logger="distill.data.tokenize"):
        DistillDataModule(tok, train=src).setup("fit")
    assert ("2 rows -> 1 examples; dropped: 1 rows whose answer the tokenizer merges with the "
            "generation prompt") in caplog.text
    path.write_text(json.dumps({"messages": TURNS[:2]}) + "\n")
    with pytest.raises(TemplateError, match="in every row the tokenizer merges the end of the "
                                            "generation prompt with the start of the answer"):
        DistillDataModule(tok, train=src).setup("fit")


def test_chat_template_override_string_and_file(tokenizers, tmp_path):
    tok = tokenizers["chatml"]
    llama3 = TEMPLATES["llama3"][0]
    path = tmp_path / "llama3.jinja"
    path.write_text(llama3)
    for override in (llama3, str(path)):
        [(ids, labels)] = ChatEncoder(tok, chat_template=override).examples(TURNS)
        assert trained_runs(tok, ids, labels) == ["Hello!<|eot_id|>", "It is 4.<|eot_id|>"]
    assert tok.chat_template == CHATML  # the tokenizer itself is left alone
    with pytest.raises(FileNotFoundError, match="neither a Jinja template .* nor an existing"):
        ChatEncoder(tok, chat_template=str(tmp_path / "missing.jinja"))


def test_no_chat_template_and_bad_options_are_refused(tokenizers):
    tok = tokenizers["chatml"]
    with pytest.raises(ValueError, match="assistant_turns must be 'all' or 'last', got 'first'"):
        ChatEncoder(tok, assistant_turns="first")
    tok.chat_template, saved = None, tok.chat_template
    try:
        with pytest.raises(TemplateError, match="no chat template: set data.chat_template="):
            ChatEncoder(tok)
    finally:
        tok.chat_template = saved


def test_template_exceptions_name_the_row(tokenizers, tmp_path):
    import json

    from distill.data import DistillDataModule

    tok = tokenizers["mistral"]  # raises when roles do not alternate
    rows = [{"messages": TURNS}, {"messages": [TURNS[0], TURNS[0], TURNS[1]]}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = DistillDataModule(tok, train=[{"name": "m", "kind": "sft", "path": str(path)}])
    with pytest.raises(TemplateError, match=r"data source 'm', row 2 \(line 2 of .*\): roles "
                                            "must alternate"):
        dm.setup("fit")


def test_marks_and_prefix_spans_agree_and_train_through_the_cli_path(compose_cfg, tmp_path):
    """The test assets' template has {% generation %} marks; without them the spans come
    from the rendering, and must be the same labels. Then a short run with the override
    (data.chat_template= a file) as the CLI passes it."""

    from distill.data.chat import MARKER
    from distill.models.causal_lm import load_tokenizer
    from distill.train import train
    from tests.fixtures import CHAT_TEMPLATE, data_from

    path = tmp_path / "plain.jinja"
    path.write_text(MARKER.sub("", CHAT_TEMPLATE.replace("{% endgeneration %}", "")))
    assert not MARKER.search(path.read_text()) and "endgeneration" not in path.read_text()
    cfg = compose_cfg("+experiment=sft_rkl", f"data.chat_template={path}",
                      "trainer.max_steps=2")
    marked = data_from(cfg, load_tokenizer(cfg.teacher.name_or_path), chat_template=None)
    marked.setup("fit")
    assert MARKER.search(marked.tokenizer.chat_template)
    tok = load_tokenizer(cfg.teacher.name_or_path)
    plain = data_from(cfg, tok)
    plain.setup("fit")
    assert plain.train_set.to_list() == marked.train_set.to_list()
    assert plain.val_set.to_list() == marked.val_set.to_list()
    assert tok.chat_template == path.read_text()  # what the export saves with the student
    assert train(cfg)["global_step"] == 2
