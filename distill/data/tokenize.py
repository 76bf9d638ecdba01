"""Rows -> examples: token ids and labels (HF convention: labels aligned with input_ids,
-100 where not trained; the model-side shift happens in the module).

- `sft`: assistant turns are trained (distill.data.chat). An example longer than
  `max_length` is truncated; one left with no trained token is dropped.
- `cpt`: every token is trained. A document longer than `max_length` is cut into windows
  of `max_length` tokens that start every `stride` tokens (default max_length - 1, so each
  window repeats the last token of the previous one as context and every token is a target
  exactly once); tokens already trained in an earlier window are labelled -100.
- `prompts`: the prompt with the generation prompt, nothing trained (on-policy: the
  student writes the completion). A prompt longer than `max_length` is dropped.

Nothing is cut or dropped silently: each source logs one line with the counts.
Example ids are `name:row`, or `name:row.k` when a row gives several examples (a val
source named like a train source: `name@val:row`).
"""

from __future__ import annotations

import logging

import datasets
import jinja2

from distill.core.constants import IGNORE_INDEX
from distill.data.chat import ChatEncoder, MergedBoundary, TemplateError
from distill.data.files import columns, source_name, where
from distill.data.rows import DataError, prompt_conversation, sft_conversation

log = logging.getLogger(__name__)
FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int64")),
    "labels": datasets.Sequence(datasets.Value("int64")),
    "example_id": datasets.Value("string"),
    "_part": datasets.Value("int32"),  # index of the example within its row
    "_cut": datasets.Value("int64"),  # tokens truncated away
    "_drop": datasets.Value("string"),  # why the row gave no example ("" when it did)
    "_need": datasets.Value("int64"),  # the max_length it would have needed
})


def cpt_ids(text: str, tokenizer) -> list[int]:
    return with_bos_eos(tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer)


def with_bos_eos(ids: list[int], tokenizer) -> list[int]:
    """A document as plain-text pretraining sees it: bos, the text, eos (where defined)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])


def cpt_windows(ids: list[int], max_length: int, stride: int | None = None):
    """(input_ids, labels) windows covering a document; see the module docstring."""
    stride = max_length - 1 if stride is None else stride
    if not 1 <= stride <= max_length or max_length < 2:
        raise ValueError(f"data.cpt_stride={stride} must be between 1 and data.max_length "
                         f"({max_length}), and max_length at least 2")
    out, trained_to, start = [], 0, 0
    while True:
        start = min(start, max(len(ids) - max_length, 0))  # the last window ends at the end
        window = ids[start:start + max_length]
        labels = [t if start + j >= trained_to else IGNORE_INDEX for j, t in enumerate(window)]
        out.append((window, labels))
        trained_to = start + len(window)
        if trained_to >= len(ids):
            return out
        start += stride


class RowEncoder:
    """One source's rows -> examples, with the reason a row gives none."""

    def __init__(self, source: dict, cols, tokenizer, max_length: int, chat: ChatEncoder | None,
                 cpt_stride: int | None):
        self.source, self.cols, self.tokenizer = source, cols, tokenizer
        self.kind = source.get("kind", "sft")
        self.max_length, self.chat, self.stride = max_length, chat, cpt_stride
        if self.kind == "cpt":  # check the stride once, not per row
            cpt_windows([0, 0], max_length, cpt_stride)

    def plan(self, row: dict, idx: int):
        """(texts to tokenize, finish(tokens) -> (examples, drop reason, max_length needed))."""
        try:
            if self.kind == "cpt":
                text = row[self.cols[0]]
                if not isinstance(text, str):
                    raise DataError(f"{where(self.source, idx)}: field {self.cols[0]!r} must "
                                    f"be a string, got {type(text).__name__}")
                return [text], lambda toks: self._cpt(toks[0])
            if self.kind == "prompts":
                msgs = prompt_conversation(row, self.cols, self.source, idx)
                return [self.chat.render(msgs, True)], lambda toks: self._prompt(toks[0])
            texts, finish = self.chat.plan(sft_conversation(row, self.cols, self.source, idx))
            return texts, lambda toks: self._sft(finish, toks, idx)
        except (TemplateError, jinja2.TemplateError) as err:
            raise TemplateError(f"{where(self.source, idx)}: {err}") from err

    def _cpt(self, ids: list[int]):
        ids = with_bos_eos(ids, self.tokenizer)
        if len(ids) < 2:
            return [], "empty", 0
        return cpt_windows(ids, self.max_length, self.stride), "", 0

    def _prompt(self, ids: list[int]):
        if len(ids) > self.max_length:
            return [], "too_long", len(ids)
        return [(ids, [IGNORE_INDEX] * len(ids))], "", 0

    def _sft(self, finish, toks, idx: int):
        try:
            examples = finish(toks)
        except MergedBoundary:
            return [], "merged", 0
        except TemplateError as err:
            raise TemplateError(f"{where(self.source, idx)}: {err}") from err
        if not examples:
            return [], "no_assistant", 0
        kept, need = [], 0
        for ids, labels in examples:
            trained = [k for k, t in enumerate(labels) if k and t != IGNORE_INDEX]
            if not trained:  # only the marker path can mark nothing
                return [], "unmarked", 0
            if trained[0] >= self.max_length:
                need = max(need, trained[0] + 1)
                continue
            kept.append((ids, labels))
        return kept, ("" if kept else "too_long"), need


def tokenize_source(ds, source: dict, tokenizer, max_length: int, *, chat_template=None,
                    assistant_turns: str = "all", cpt_stride: int | None = None,
                    chat_template_kwargs: dict | None = None, num_proc: int | None = None):
    """Map one raw source to input_ids / labels / example_id; refuse it if nothing trains.
    `num_proc` > 1 tokenizes in that many processes (datasets.map)."""
    kind, name = source.get("kind", "sft"), source_name(source)
    known_as = source.get("ids", name)  # what example ids start with (DistillDataModule)
    chat = None if kind == "cpt" else ChatEncoder(tokenizer, chat_template, assistant_turns,
                                                  chat_template_kwargs)
    encode_row = RowEncoder(source, columns(source, ds.column_names), tokenizer, max_length,
                            chat, cpt_stride)

    def encode(batch, indices):
        out = {k: [] for k in FEATURES}
        plans = [encode_row.plan({c: batch[c][j] for c in batch}, idx)
                 for j, idx in enumerate(indices)]
        texts = [t for row_texts, _ in plans for t in row_texts]
        # one call for the whole batch: the tokenizer's own threads share it out
        toks = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        at = 0
        for (row_texts, finish), idx in zip(plans, indices):
            examples, drop, need = finish(toks[at:at + len(row_texts)])
            at += len(row_texts)
            if drop:  # a placeholder row carries the reason to the summary
                examples = [([], [])]
            for k, (ids, labels) in enumerate(examples):
                eid = f"{known_as}:{idx}" if len(examples) == 1 else f"{known_as}:{idx}.{k}"
                cut = max(0, len(ids) - max_length)
                for key, v in zip(FEATURES, (ids[:max_length], labels[:max_length], eid, k,
                                             cut, drop, need)):
                    out[key].append(v)
        return out

    tok = ds.map(encode, with_indices=True, batched=True, remove_columns=ds.column_names,
                 features=FEATURES, num_proc=num_proc if num_proc and num_proc > 1 else None,
                 desc=f"tokenizing {name}")
    report(tok, source, len(ds), max_length, lambda: roles_of(ds, encode_row.cols))
    tok = tok.filter(lambda d: not d, input_columns="_drop", desc=f"filtering {name}")
    return tok.remove_columns(["_part", "_cut", "_drop", "_need"])


def roles_of(ds, cols, rows: int = 1000) -> list[str]:
    """The roles the first rows' messages have (for the error of a source that has none
    of the trained role)."""
    found = set()
    for col in cols:
        for value in ds.select(range(min(rows, len(ds))))[col]:
            if isinstance(value, list):
                found |= {str(m.get("role")) for m in value if isinstance(m, dict)}
    return sorted(found)


def report(tok, source: dict, rows: int, max_length: int, roles=None) -> None:
    """One log line per source with what was cut or dropped; an error when nothing is left.
    `roles()` gives the roles found, named when no row has an assistant turn."""
    name, kind = source_name(source), source.get("kind", "sft")
    drops, cuts, parts = tok["_drop"], tok["_cut"], tok["_part"]
    count = {r: drops.count(r) for r in set(drops) - {""}}
    kept = len(drops) - sum(count.values())
    if kept == 0:
        need = min((n for n, d in zip(tok["_need"], drops) if d == "too_long"), default=0)
        found = roles() if roles is not None and count.get("no_assistant") else None
        raise_empty(name, kind, rows, count, need, max_length, found)
    truncated = sum(1 for c, d in zip(cuts, drops) if c and not d)
    parts_note = ""
    if kind == "sft" and parts.count(1):
        parts_note = (f"; {parts.count(1)} rows became one example per assistant turn (the "
                      "chat template rewrites earlier turns)")
    why = {**WHY, "too_long": "prompts longer than max_length"} if kind == "prompts" else WHY
    note = "; ".join(f"{n} {why[r]}" for r, n in sorted(count.items()))
    line = (f"data source {name!r} ({kind}): {rows} rows -> {kept} examples"
            + (f"; {truncated} truncated to max_length={max_length} "
               f"({sum(cuts)} tokens cut)" if truncated else "")
            + (f"; dropped: {note}" if note else "") + parts_note)
    (log.warning if truncated or count else log.info)(line)


WHY = {"no_assistant": "rows without an assistant turn",
       "unmarked": "rows whose {% generation %} marks cover no token",
       "too_long": "examples longer than max_length with no trained token left",
       "empty": "empty texts",
       "merged": "rows whose answer the tokenizer merges with the generation prompt"}


def raise_empty(name, kind, rows, count, need, max_length, roles=None) -> None:
    if count.get("too_long"):
        what = "every prompt is longer" if kind == "prompts" else "no assistant token fits"
        raise ValueError(f"data.max_length={max_length} is too short for the prompts of data "
                         f"source {name!r}: {what} (the shortest example needs max_length >= "
                         f"{need}); raise data.max_length")
    if count.get("no_assistant"):
        found = f" (the roles found: {', '.join(roles)})" if roles else ""
        raise ValueError(f"data source {name!r} has no trainable token: none of its {rows} "
                         f"rows has an assistant turn (role 'assistant'){found}; SFT trains "
                         "the assistant turns; for prompts only (on-policy) set kind: prompts")
    if count.get("merged"):
        raise TemplateError(f"data source {name!r} has no trainable token: in every row the "
                            "tokenizer merges the end of the generation prompt with the start "
                            "of the answer into one token, so the tokens the model writes are "
                            "not defined; the generation prompt must end where a token ends "
                            "(a special token, or whitespace the answers do not continue): "
                            "fix it with data.chat_template=")
    if count.get("unmarked"):
        raise TemplateError(f"data source {name!r} has no trainable token: the chat "
                            "template's {% generation %} marks cover no token of the "
                            "assistant turns; fix the marks, or drop them (data.chat_template="
                            ") and the spans are found from the rendering")
    raise ValueError(f"data source {name!r} has no trainable token: its {rows} texts are "
                     "empty")


def longest(*sets) -> int:
    """The most tokens of one example in these tokenized sets (None ones skipped)."""
    import pyarrow.compute as pc

    out = 0
    for ds in sets:
        if ds is not None and len(ds):
            lengths = pc.list_value_length(ds.data.column("input_ids"))
            out = max(out, int(pc.max(lengths).as_py() or 0))
    return out
