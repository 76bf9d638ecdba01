"""Align two tokenizations of the same text into spans whose boundaries coincide.

Each side gives, per token, the byte range it covers in its own rendering. A byte position
is a *boundary* of a side when a token ends there and the next token starts at or after it
(two byte-level tokens that split one character share that character's offsets, so the
position between them is no boundary). The spans are the stretches between consecutive
boundaries common to both sides: within a span the two sides cover exactly the same bytes,
so the sum of a span's token log-probabilities is, on either side, the log-probability of
the same text.

The two renderings need not be byte-identical: Llama-3's template trims an answer that
ChatML keeps as it is, a sampled completion may end inside a character. The texts are
compared with difflib's matching blocks, and a span is kept only when it lies inside one
block (the same text on both sides); tokens in the differing stretches belong to no span.

Control tokens at the ends of a run (the end-of-turn token, a document's eos) have no text
in common (`<|im_end|>` vs `<|eot_id|>`): they are paired one-to-one from the run's ends.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


class AlignmentError(ValueError):
    """The two sides of an example cannot be paired (e.g. different numbers of assistant
    runs); the example is dropped and counted."""


@dataclass
class Run:
    """A run of consecutive trained tokens of one side."""

    start: int  # index of its first token in the example
    spans: list[tuple[int, int]]  # byte range of each token in `text`
    special: list[bool]  # control token?
    text: bytes  # the rendering `spans` index into


def char_to_byte_offsets(text: str, offsets) -> list[tuple[int, int]]:
    """Character offsets (a fast tokenizer's offset_mapping) as UTF-8 byte offsets."""
    if text.isascii():
        return [(int(a), int(b)) for a, b in offsets]
    prefix = [0]
    for ch in text:
        prefix.append(prefix[-1] + len(ch.encode("utf-8", "surrogatepass")))
    return [(prefix[a], prefix[b]) for a, b in offsets]


def _edges(special: list[bool]) -> tuple[int, int]:
    """[lo, hi): the run without its leading and trailing control tokens."""
    lo, hi = 0, len(special)
    while lo < hi and special[lo]:
        lo += 1
    while hi > lo and special[hi - 1]:
        hi -= 1
    return lo, hi


def _boundaries(spans: list[tuple[int, int]], base: int) -> dict[int, int]:
    """Byte position (relative to `base`) -> index of the last token ending there, for the
    positions where the tokenization has a boundary; 0 -> -1 (before the first token)."""
    out, last = {0: -1}, 0
    for k, (_, b) in enumerate(spans):
        nxt = spans[k + 1][0] if k + 1 < len(spans) else None
        if b >= last and (nxt is None or nxt >= b):
            out[b - base] = k
            last = b
    return out


def _blocks(s: bytes, t: bytes) -> list[tuple[int, int, int]]:
    if s == t:
        return [(0, 0, len(s))]
    matcher = difflib.SequenceMatcher(None, s, t, autojunk=False)
    return [(a, b, n) for a, b, n in matcher.get_matching_blocks() if n]


def _body_spans(s_spans, t_spans, s_text: bytes, t_text: bytes):
    """Spans (s_lo, s_hi, t_lo, t_hi) of token indices (relative) over two bodies."""
    if not s_spans or not t_spans:
        return []
    s_base, t_base = s_spans[0][0], t_spans[0][0]
    s_body = s_text[s_base:s_spans[-1][1]]
    t_body = t_text[t_base:t_spans[-1][1]]
    s_bound, t_bound = _boundaries(s_spans, s_base), _boundaries(t_spans, t_base)
    out = []
    for a, b, n in _blocks(s_body, t_body):
        common = [(i, i - a + b) for i in sorted(s_bound)
                  if a <= i <= a + n and (i - a + b) in t_bound]
        for (i0, j0), (i1, j1) in zip(common, common[1:]):
            out.append((s_bound[i0] + 1, s_bound[i1] + 1, t_bound[j0] + 1, t_bound[j1] + 1))
    return out


def align_runs(student: Run, teacher: Run) -> list[tuple[int, int, int, int]]:
    """Spans [s_lo, s_hi) x [t_lo, t_hi) of example token indices, in order."""
    s_lo, s_hi = _edges(student.special)
    t_lo, t_hi = _edges(teacher.special)
    spans = [(s, s + 1, t, t + 1) for s, t in zip(range(s_lo), range(t_lo))]
    body = _body_spans(student.spans[s_lo:s_hi], teacher.spans[t_lo:t_hi],
                       student.text, teacher.text)
    spans += [(s_lo + a, s_lo + b, t_lo + c, t_lo + d) for a, b, c, d in body]
    s_trail = range(len(student.special) - 1, s_hi - 1, -1)
    t_trail = range(len(teacher.special) - 1, t_hi - 1, -1)
    spans += sorted((s, s + 1, t, t + 1) for s, t in zip(s_trail, t_trail))
    return [(student.start + a, student.start + b, teacher.start + c, teacher.start + d)
            for a, b, c, d in spans]


def trained_runs(labels: list[int], ignore_index: int = -100) -> list[tuple[int, int]]:
    """[start, end) of the maximal runs of trained tokens; token 0 is never predicted."""
    runs, start = [], None
    for k in range(1, len(labels) + 1):
        on = k < len(labels) and labels[k] != ignore_index
        if on and start is None:
            start = k
        elif not on and start is not None:
            runs.append((start, k))
            start = None
    return runs
