"""The template matrix: every pair of three families' tokenizers and chat templates."""

import pytest

from distill.data.chat import ChatEncoder, MergedBoundary
from distill.xtok import AlignmentError, PairEncoder, VocabMap, truncate
from distill.xtok.align import Run, align_runs
from distill.xtok.pairing import windows
from tests.data.templates import MARKED, MISTRAL, QWEN3, make_chat_tokenizer
from tests.xtok.families import FAMILIES, make_family_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 123 + 456?"},
            {"role": "assistant", "content": "Sure, 123 + 456 = 579. Café 日本語!"},
            {"role": "user", "content": "Two lines?"},
            {"role": "assistant", "content": "line one\nline two"}]
ANSWERS = [MESSAGES[2]["content"], MESSAGES[4]["content"]]
PAIRS = [(s, t) for s in FAMILIES for t in FAMILIES]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: make_family_tokenizer(name, root / name) for name in FAMILIES}


def pair(toks, student, teacher, s_template=None, t_template=None):
    return PairEncoder(ChatEncoder(toks[student], s_template),
                       ChatEncoder(toks[teacher], t_template))


def span_texts(ex, s_tok, t_tok):
    return [(s_tok.decode(ex["input_ids"][a:b]), t_tok.decode(ex["teacher_input_ids"][c:d]))
            for a, b, c, d in ex["xtok_spans"]]


@pytest.mark.parametrize("student,teacher", PAIRS)
def test_template_matrix(toks, student, teacher):
    s_tok, t_tok = toks[student], toks[teacher]
    [ex] = pair(toks, student, teacher).examples(MESSAGES)
    spans = ex["xtok_spans"]
    # every trained student token is in exactly one span, and only trained ones are
    covered = [k for a, b, _, _ in spans for k in range(a, b)]
    assert len(covered) == len(set(covered)) == ex["xtok_counts"][0] == ex["xtok_counts"][1]
    assert all(ex["labels"][k] != -100 for k in covered)
    assert all(ex["teacher_labels"][k] != -100 for _, _, c, d in spans for k in range(c, d))
    assert spans == sorted(spans)
    eot = (FAMILIES[student][3], FAMILIES[teacher][3])
    texts = span_texts(ex, s_tok, t_tok)
    # the same text on both sides, except the end-of-turn tokens paired with each other
    assert all(s == t or (s, t) == eot for s, t in texts)
    assert sum(1 for x in texts if x == eot) == 2
    joined = "".join(s for s, _ in texts)
    assert joined == ANSWERS[0] + eot[0] + ANSWERS[1] + eot[0]
    multi = [s for s in spans if s[1] - s[0] > 1 or s[3] - s[2] > 1]
    if student == teacher:  # one tokenizer: the same tokens on both sides
        assert all(ex["input_ids"][a:b] == ex["teacher_input_ids"][c:d]
                   for a, b, c, d in spans)
    else:  # numbers and rarer words split differently
        assert len(multi) >= 3


@pytest.mark.parametrize("student,teacher", PAIRS)
def test_vocab_map(toks, student, teacher):
    s_tok, t_tok = toks[student], toks[teacher]
    equivalent = pair(toks, student, teacher).special_equivalents()
    assert equivalent == [(FAMILIES[student][3], FAMILIES[teacher][3])]
    vmap = VocabMap.build(s_tok, t_tok, equivalent)
    if student == teacher:
        assert vmap.is_identity
        return
    assert 0.6 * min(len(s_tok), len(t_tok)) < len(vmap) < min(len(s_tok), len(t_tok))
    specials = {s_tok.convert_tokens_to_ids(equivalent[0][0])}
    for s, t in zip(vmap.student_ids.tolist(), vmap.teacher_ids.tolist()):
        if s not in specials:  # a pair is the same text
            assert s_tok.decode([s]) == t_tok.decode([t]) or "\ufffd" in s_tok.decode([s])
    # a control token never pairs with text that spells it
    s_eot = s_tok.convert_tokens_to_ids(FAMILIES[student][3])
    t_eot = t_tok.convert_tokens_to_ids(FAMILIES[teacher][3])
    assert dict(zip(vmap.student_ids.tolist(), vmap.teacher_ids.tolist()))[s_eot] == t_eot


def test_text_one_template_trims_is_left_out(toks):
    """Llama-3's template trims the answer, ChatML's keeps it: the student's tokens of the
    whitespace only ChatML renders are in no span (they keep their CE term)."""
    msgs = [MESSAGES[1], {"role": "assistant", "content": "  Sure, 579.  "}]
    for student, teacher, trims in (("qwen", "llama3", False), ("llama3", "qwen", True)):
        [ex] = pair(toks, student, teacher).examples(msgs)
        texts = span_texts(ex, toks[student], toks[teacher])
        assert "".join(s for s, _ in texts) == "Sure, 579." + FAMILIES[student][3]
        trained, aligned = ex["xtok_counts"]
        assert (trained == aligned) == trims
        covered = {k for a, b, _, _ in ex["xtok_spans"] for k in range(a, b)}
        outside = [k for k, y in enumerate(ex["labels"]) if k and y != -100 and k not in covered]
        assert all(not toks[student].decode([ex["input_ids"][k]]).strip() for k in outside)


def test_merged_boundary_and_rewriting_templates(toks):
    with pytest.raises(MergedBoundary):  # as without a teacher: the row is dropped
        pair(toks, "qwen", "llama3").examples([MESSAGES[1], {"role": "assistant",
                                                             "content": "\nSure"}])
    # Qwen3 rewrites earlier turns: both sides become one example per assistant turn
    msgs = [MESSAGES[1], {"role": "assistant", "content": "<think>\nadd\n</think>\n\n579."},
            MESSAGES[3], {"role": "assistant", "content": "line one\nline two"}]
    exs = pair(toks, "llama3", "qwen", t_template=QWEN3).examples(msgs)
    assert len(exs) == 2
    texts = span_texts(exs[0], toks["llama3"], toks["qwen"])
    assert "".join(s for s, _ in texts) == "<think>\nadd\n</think>\n\n579.<|eot_id|>"
    assert all(e["xtok_counts"][0] == e["xtok_counts"][1] for e in exs)


def test_truncate_keeps_whole_spans(toks):
    [ex] = pair(toks, "qwen", "llama3").examples(MESSAGES)
    cut = truncate(ex, max_length=ex["xtok_spans"][5][1] + 1,
                   teacher_max_length=ex["xtok_spans"][3][3])
    assert cut["xtok_spans"] == ex["xtok_spans"][:4]
    assert len(cut["input_ids"]) == ex["xtok_spans"][5][1] + 1


def test_plain_text_documents(toks):
    text = "The sum of 123 and 456 is 579; Café 日本語."
    ex = pair(toks, "llama3", "gemma").plain_text(text)
    texts = span_texts(ex, toks["llama3"], toks["gemma"])
    assert texts[-1] == ("<|eot_id|>", "<end_of_turn>")  # eos with eos
    assert "".join(s for s, _ in texts[:-1]) == text  # after the bos, every token
    # no bos on the student's side: its first text token is context, not a target
    ex = pair(toks, "qwen", "llama3").plain_text(text)
    assert ex["xtok_counts"][0] - ex["xtok_counts"][1] <= 1


def test_alignment_by_bytes_within_a_character():
    """Two byte-level tokens of one character share its offsets: no boundary between."""
    text = "a語b".encode()
    s = Run(0, [(0, 1), (1, 4), (1, 4), (4, 5)], [False] * 4, text)
    t = Run(10, [(0, 1), (1, 4), (4, 5)], [False] * 3, text)
    assert align_runs(s, t) == [(0, 1, 10, 11), (1, 3, 11, 12), (3, 4, 12, 13)]
    u = Run(0, [(0, 2), (1, 5)], [False] * 2, text)  # a token straddling the character
    assert align_runs(u, t) == [(0, 2, 10, 13)]


def test_different_run_counts_are_refused(toks):
    enc = pair(toks, "qwen", "llama3")
    s = ([1, 2, 3, 4], [-100, 2, -100, 4], "abcd", [(0, 1), (1, 2), (2, 3), (3, 4)])
    t = ([1, 2, 3, 4], [-100, 2, 3, 4], "abcd", [(0, 1), (1, 2), (2, 3), (3, 4)])
    with pytest.raises(AlignmentError, match="trained runs"):
        enc._pair(s, t)


def test_long_documents_are_windowed_like_cpt(toks):
    text = " ".join(["The sum of 123 and 456 is 579; Café 日本語."] * 6)
    whole = pair(toks, "qwen", "llama3").plain_text(text)
    wins = windows(whole, max_length=24)
    assert len(wins) > 3
    trained = [y for w in wins for k, y in enumerate(w["labels"]) if k and y != -100]
    assert trained == whole["input_ids"][1:]  # each student token trained once
    kept = 0
    for w in wins:
        texts = span_texts(w, toks["qwen"], toks["llama3"])
        assert all(s == t or (s, t) == ("<|im_end|>", "<|eot_id|>") for s, t in texts)
        assert all(w["labels"][a] != -100 for a, _, _, _ in w["xtok_spans"])
        assert w["teacher_labels"][0] == -100 and len(w["teacher_input_ids"]) <= 24
        kept += w["xtok_counts"][1]
    assert kept > 0.8 * whole["xtok_counts"][1]  # only spans split by an edge are lost


@pytest.mark.parametrize("template,extra", [(MARKED, 0), (MISTRAL, 2)])
def test_marked_and_mistral_templates_with_a_character_tokenizer(toks, tmp_path, template,
                                                                 extra):
    """{% generation %} marks, and Mistral's answers (" " + text + "</s>": the space the
    Llama-3 teacher does not render is in no span)."""
    chars = make_chat_tokenizer(tmp_path / "chars", template)
    msgs = [m if m["role"] != "assistant" else {**m, "content": m["content"][:22]}
            for m in MESSAGES[1:]]
    [ex] = PairEncoder(ChatEncoder(chars), ChatEncoder(toks["llama3"])).examples(msgs)
    trained, aligned = ex["xtok_counts"]
    assert trained - aligned == extra
    eot = chars.convert_ids_to_tokens(ex["input_ids"][ex["xtok_spans"][-1][0]])
    assert eot == ("<|end|>" if template is MARKED else "</s>")
