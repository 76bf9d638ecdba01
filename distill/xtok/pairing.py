"""One conversation (or document) -> a student example, a teacher example and their spans.

Each model renders the messages with its own chat template and derives its own assistant
labels (`distill.data.chat.ChatEncoder`); the student is trained on its tokens, labels and
masks exactly as without a teacher. The k-th trained run of the student (an assistant turn,
its end-of-turn token included) is paired with the k-th run of the teacher, and the two runs
are aligned by their text (`distill.xtok.align`).

A paired example is a dict:

    input_ids, labels            the student's, as ChatEncoder gives them
    teacher_input_ids            the teacher's tokens of its own rendering
    teacher_labels               its assistant labels (the teacher's trained positions)
    teacher_offsets              (with_offsets) byte range of each teacher token
    xtok_spans                   [(s_lo, s_hi, t_lo, t_hi)]: token indices (label coordinates)
                                 of the aligned spans; token k is predicted by position k - 1
    xtok_counts                  (trained student tokens, of which inside a span)

When the two templates split a conversation into different numbers of examples (a template
that rewrites earlier turns, like Qwen3's) both sides fall back to one example per assistant
turn, each trained on its last turn only.
"""

from __future__ import annotations

from distill.core.constants import IGNORE_INDEX
from distill.data.chat import ChatEncoder, TemplateError
from distill.data.tokenize import cpt_windows, with_bos_eos
from distill.xtok.align import AlignmentError, Run, align_runs, char_to_byte_offsets, trained_runs
from distill.xtok.vocab import special_ids


def _tokenize(tokenizer, texts: list[str]):
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


def encode_with_offsets(encoder: ChatEncoder, messages: list[dict]):
    """ChatEncoder's examples as (ids, labels, rendered text, char offsets) tuples."""
    texts, finish = encoder.plan(messages)
    if not texts:  # {% generation %} marks: the whole conversation, rendered once
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        texts = [encoder.render(messages[:turns[-1] + 1], False)] if turns else []
        examples = encoder.examples(messages)
    else:
        examples = None
    ids, offsets = _tokenize(encoder.tokenizer, texts) if texts else ([], [])
    if examples is None:
        examples = finish(ids)
    out = []
    for ex_ids, labels in examples:
        k = next((k for k in range(len(ids) - 1, -1, -1) if ids[k] == list(ex_ids)), None)
        if k is None:
            raise TemplateError("cross-tokenizer pairing: an example's tokens are not the "
                                "tokenization of any rendering of its conversation")
        out.append((list(ex_ids), list(labels), texts[k], offsets[k]))
    return out


class PairEncoder:
    """Renders each conversation for both models and aligns their assistant runs."""

    def __init__(self, student: ChatEncoder, teacher: ChatEncoder, with_offsets: bool = False):
        self.student, self.teacher = student, teacher
        self.with_offsets = with_offsets  # keep the teacher's byte offsets (for its cache)
        self._special = (special_ids(student.tokenizer), special_ids(teacher.tokenizer))
        self._last = None  # last-turn encoders, made when a conversation needs them

    # --- chats -------------------------------------------------------------------------
    def examples(self, messages: list[dict]) -> list[dict]:
        """Paired examples of one conversation ([] without assistant turns). Raises
        MergedBoundary / TemplateError as ChatEncoder does, AlignmentError when the two
        renderings cannot be paired."""
        s = encode_with_offsets(self.student, messages)
        t = encode_with_offsets(self.teacher, messages)
        if len(s) != len(t) or any(len(trained_runs(a[1])) != len(trained_runs(b[1]))
                                   for a, b in zip(s, t)):
            s, t = self._per_turn(messages)
        return [self._pair(a, b) for a, b in zip(s, t)]

    def _per_turn(self, messages):
        if self._last is None:
            self._last = tuple(ChatEncoder(e.tokenizer, e.template, "last", e.kwargs)
                               for e in (self.student, self.teacher))
        s, t = [], []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                s += encode_with_offsets(self._last[0], messages[:i + 1])
                t += encode_with_offsets(self._last[1], messages[:i + 1])
        if len(s) != len(t):
            raise AlignmentError(f"the student's template gives {len(s)} examples of this "
                                 f"conversation and the teacher's {len(t)}, even turn by turn")
        return s, t

    def prompt(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Each model's prompt tokens (its generation prompt included), for on-policy rows."""
        return self.student.prompt(messages), self.teacher.prompt(messages)

    # --- plain text (CPT) ------------------------------------------------------------------
    def plain_text(self, text: str) -> dict:
        """A document as pretraining sees it on each side: bos, the text, eos; every token
        after the first trained."""
        sides = []
        for tok in (self.student.tokenizer, self.teacher.tokenizer):
            ids, offs = _tokenize(tok, [text])
            ids, offs = ids[0], list(offs[0])
            full = with_bos_eos(ids, tok)
            lead = len(full) - len(ids) - (tok.eos_token_id is not None)
            offs = [(0, 0)] * lead + offs + [(len(text), len(text))] * (len(full) - lead - len(ids))
            sides.append((full, list(full), text, offs))
        return self._pair(*sides)

    # --- one example -----------------------------------------------------------------------
    def _pair(self, s, t) -> dict:
        (s_ids, s_labels, s_text, s_offs), (t_ids, t_labels, t_text, t_offs) = s, t
        s_runs, t_runs = trained_runs(s_labels), trained_runs(t_labels)
        if len(s_runs) != len(t_runs):
            raise AlignmentError(f"the student has {len(s_runs)} trained runs and the teacher "
                                 f"{len(t_runs)}: no pairing of assistant turns")
        s_side = (s_ids, char_to_byte_offsets(s_text, s_offs), s_text.encode(), self._special[0])
        t_side = (t_ids, char_to_byte_offsets(t_text, t_offs), t_text.encode(), self._special[1])
        spans = []
        for s_run, t_run in zip(s_runs, t_runs):
            spans += align_runs(_run(s_side, *s_run), _run(t_side, *t_run))
        out = paired_example(s_ids, s_labels, t_ids, t_labels, spans)
        if self.with_offsets:
            out["teacher_offsets"] = t_side[1]
        return out

    def special_equivalents(self) -> list[tuple[str, str]]:
        """(student, teacher) control tokens that close an assistant turn, found by pairing
        a probe conversation: the end-of-turn tokens, for `VocabMap.build(equivalent=)`."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
        ex = self.examples(probe)[0]
        s_tok, t_tok = self.student.tokenizer, self.teacher.tokenizer
        out = []
        for a, b, c, d in ex["xtok_spans"]:
            s_id, t_id = ex["input_ids"][a], ex["teacher_input_ids"][c]
            if b - a == d - c == 1 and s_id in self._special[0] and t_id in self._special[1]:
                out.append((s_tok.convert_ids_to_tokens(s_id), t_tok.convert_ids_to_tokens(t_id)))
        return out


def _run(side, start: int, end: int) -> Run:
    ids, spans, text, special = side
    return Run(start, spans[start:end], [i in special for i in ids[start:end]], text)


def paired_example(s_ids, s_labels, t_ids, t_labels, spans) -> dict:
    trained = sum(1 for k, y in enumerate(s_labels) if k and y != IGNORE_INDEX)
    aligned = sum(b - a for a, b, _, _ in spans)
    return {"input_ids": list(s_ids), "labels": list(s_labels),
            "teacher_input_ids": list(t_ids), "teacher_labels": list(t_labels),
            "xtok_spans": [tuple(x) for x in spans], "xtok_counts": (trained, aligned)}


def truncate(example: dict, max_length: int, teacher_max_length: int | None = None) -> dict:
    """Cut both sides (the teacher at `teacher_max_length`, default max_length); a span
    survives only when both of its sides do. The student keeps its labels either way."""
    t_max = teacher_max_length or max_length
    s_ids, s_labels = example["input_ids"][:max_length], example["labels"][:max_length]
    t_ids, t_labels = (example["teacher_input_ids"][:t_max],
                       example["teacher_labels"][:t_max])
    spans = [x for x in example["xtok_spans"] if x[1] <= len(s_ids) and x[3] <= len(t_ids)]
    out = dict(example)
    out.update(paired_example(s_ids, s_labels, t_ids, t_labels, spans))
    return out


def windows(example: dict, max_length: int, stride: int | None = None,
            teacher_max_length: int | None = None) -> list[dict]:
    """A long paired document as the student's CPT windows (`cpt_windows`: each student
    token trained once), each with the teacher tokens of its spans. A span is kept in the
    window that trains all of its student tokens; the teacher's window starts one token
    before its first kept span (context, as the student's first token is) and is cut at
    `teacher_max_length`. A span split by a window edge keeps the student's CE only."""
    t_max = teacher_max_length or max_length
    out, start = [], 0
    spans = example["xtok_spans"]
    t_ids = example["teacher_input_ids"]
    for s_ids, s_labels in cpt_windows(example["input_ids"], max_length, stride):
        start = _window_start(example["input_ids"], s_ids, start)
        end = start + len(s_ids)
        trained = {start + k for k, y in enumerate(s_labels) if k and y != IGNORE_INDEX}
        kept = [x for x in spans if all(k in trained for k in range(x[0], x[1]))]
        t_lo = (kept[0][2] - 1) if kept else 0
        kept = [x for x in kept if x[3] - t_lo <= t_max and x[1] <= end]
        t_hi = kept[-1][3] if kept else min(len(t_ids), t_lo + 1)
        t_labels = [IGNORE_INDEX] * (t_hi - t_lo)
        for _, _, c, d in kept:
            t_labels[c - t_lo:d - t_lo] = t_ids[c:d]
        local = [(a - start, b - start, c - t_lo, d - t_lo) for a, b, c, d in kept]
        out.append({**example, **paired_example(s_ids, s_labels, t_ids[t_lo:t_hi], t_labels,
                                                local)})
    return out


def _window_start(ids: list[int], window: list[int], after: int) -> int:
    """Where `window` starts in `ids` (at or after `after`): cpt_windows does not say."""
    for k in range(after, len(ids) - len(window) + 1):
        if ids[k:k + len(window)] == window:
            return k
    raise ValueError("a CPT window is not a slice of its document")
