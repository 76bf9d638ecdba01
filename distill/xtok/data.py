"""Data sources -> paired examples: each row tokenized for the student and for the teacher.

The cross-tokenizer counterpart of `distill.data.tokenize.tokenize_source`: SFT rows give
`PairEncoder.examples` (each model renders the chat with its own template; rows whose two
renderings cannot be paired are dropped and counted, as rows the tokenizer merges at the
answer's start are), CPT texts give the student's `cpt_windows` with the teacher tokens of
their spans, and prompt rows give each model's prompt (on-policy: nothing trained yet).
The student's labels, masks and normalization are exactly those of a one-tokenizer run.
"""

from __future__ import annotations

import logging

import datasets

from distill.core.constants import IGNORE_INDEX
from distill.data.chat import ChatEncoder, MergedBoundary, TemplateError, resolve_template
from distill.data.files import columns, source_name, where
from distill.data.rows import prompt_conversation, sft_conversation
from distill.xtok.align import AlignmentError
from distill.xtok.pairing import PairEncoder, truncate, windows

log = logging.getLogger(__name__)
FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int64")),
    "labels": datasets.Sequence(datasets.Value("int64")),
    "teacher_input_ids": datasets.Sequence(datasets.Value("int64")),
    "teacher_labels": datasets.Sequence(datasets.Value("int64")),
    "xtok_spans": datasets.Sequence(datasets.Sequence(datasets.Value("int64"))),
    # (the caching job's pair encoder keeps them): byte range of each teacher token
    "teacher_offsets": datasets.Sequence(datasets.Sequence(datasets.Value("int64"))),
    "example_id": datasets.Value("string"),
    "_drop": datasets.Value("string"),
})
WHY = {"merged": "rows whose answer a tokenizer merges with the generation prompt",
       "unaligned": "rows whose two renderings cannot be paired turn by turn",
       "no_assistant": "rows without an assistant turn", "too_long": "too long rows",
       "empty": "empty texts"}


def pair_encoder(student_tok, teacher_tok, cfg) -> PairEncoder:
    """Both models' chat encoders from the `data:` settings (`teacher_chat_template`: the
    teacher's own template, default its tokenizer's)."""
    kwargs = dict(cfg.chat_template_kwargs or {})
    return PairEncoder(
        ChatEncoder(student_tok, cfg.chat_template, cfg.assistant_turns, kwargs),
        ChatEncoder(teacher_tok, resolve_template(cfg.teacher_chat_template),
                    cfg.assistant_turns, kwargs))


def _row_examples(pair, source, cols, row, idx, max_length, t_max, stride):
    kind = source.get("kind", "sft")
    if kind == "cpt":
        text = row[cols[0]]
        if not text:
            return [], "empty"
        return windows(pair.plain_text(text), max_length, stride, t_max), ""
    if kind == "prompts":
        s_ids, t_ids = pair.prompt(prompt_conversation(row, cols, source, idx))
        if len(s_ids) > max_length:
            return [], "too_long"
        return [{"input_ids": s_ids, "labels": [IGNORE_INDEX] * len(s_ids),
                 "teacher_input_ids": t_ids, "teacher_labels": [IGNORE_INDEX] * len(t_ids),
                 "xtok_spans": []}], ""
    try:
        found = pair.examples(sft_conversation(row, cols, source, idx))
    except MergedBoundary:
        return [], "merged"
    except AlignmentError:
        return [], "unaligned"
    except TemplateError as err:
        raise TemplateError(f"{where(source, idx)}: {err}") from err
    if not found:
        return [], "no_assistant"
    return [truncate(ex, max_length, t_max) for ex in found], ""


def tokenize_pair_source(ds, source: dict, pair: PairEncoder, max_length: int,
                         teacher_max_length: int | None = None, cpt_stride=None,
                         num_proc: int | None = None):
    name = source_name(source)
    cols = columns(source, ds.column_names)

    def encode(batch, indices):
        out = {k: [] for k in FEATURES}
        for j, idx in enumerate(indices):
            row = {c: batch[c][j] for c in batch}
            examples, drop = _row_examples(pair, source, cols, row, idx, max_length,
                                           teacher_max_length, cpt_stride)
            if drop:
                examples = [{"input_ids": [], "labels": [], "teacher_input_ids": [],
                             "teacher_labels": [], "xtok_spans": []}]
            for k, ex in enumerate(examples):
                out["example_id"].append(f"{name}:{idx}" if len(examples) == 1
                                         else f"{name}:{idx}.{k}")
                out["_drop"].append(drop)
                for key in ("input_ids", "labels", "teacher_input_ids", "teacher_labels"):
                    out[key].append(list(ex[key]))
                out["xtok_spans"].append([list(s) for s in ex["xtok_spans"]])
                out["teacher_offsets"].append([list(o) for o in ex.get("teacher_offsets", [])])
        return out

    tok = ds.map(encode, with_indices=True, batched=True, remove_columns=ds.column_names,
                 features=FEATURES, num_proc=num_proc if num_proc and num_proc > 1 else None,
                 desc=f"tokenizing {name} for both models")
    drops = tok["_drop"]
    count = {r: drops.count(r) for r in set(drops) - {""}}
    kept = len(drops) - sum(count.values())
    if kept == 0:
        raise ValueError(f"data source {name!r} has no example both models can be trained "
                         f"on: {', '.join(f'{n} {WHY[r]}' for r, n in count.items())}")
    note = "; ".join(f"{n} {WHY[r]}" for r, n in sorted(count.items()))
    (log.warning if count else log.info)(
        f"data source {name!r} (cross-tokenizer): {len(ds)} rows -> {kept} paired examples"
        + (f"; dropped: {note}" if note else ""))
    tok = tok.filter(lambda d: not d, input_columns="_drop", desc=f"filtering {name}")
    return tok.remove_columns(["_drop"])
