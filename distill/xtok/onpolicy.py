"""On-policy rows across tokenizers: a sampled completion, re-tokenized for the other model.

The student samples in its own tokens (distill.rollout); those tokens are what it is
trained on, so they are kept exactly as sampled, even where they are not the canonical
tokenization of their text. The teacher scores the same *text*: the completion's bytes
(from the student's vocabulary, `vocab.token_bytes`) decoded to a string and tokenized
by the teacher on its own, after the teacher's prompt (its template's rendering of the
same messages; the batch keeps it as `teacher_input_ids[:, :teacher_prompt_lengths]`).
A completion that stopped on a stop token gets the teacher's end-of-turn token, and the two
are paired. A sample cut inside a UTF-8 character decodes to U+FFFD for the teacher: the
bytes differ there and that stretch is in no span.

`Retokenizer.teacher_sample` is the mirror (GKD's teacher-written rows): the teacher's
completion re-tokenized for the student, who is trained on its own tokens of that text.
"""

from __future__ import annotations

from distill.xtok.align import Run, align_runs, char_to_byte_offsets
from distill.xtok.pairing import paired_example
from distill.xtok.vocab import special_ids, token_bytes

IGNORE_INDEX = -100


class _Side:
    def __init__(self, tokenizer, end_of_turn: str):
        self.tokenizer = tokenizer
        self.bytes = token_bytes(tokenizer)
        self.special = special_ids(tokenizer)
        self.eot = tokenizer.convert_tokens_to_ids(end_of_turn)

    def sampled(self, completion: list[int]):
        """(byte spans, special flags, text bytes) of the sampled tokens up to the first
        control token (the stop token) included; any tokens after it are in no span."""
        spans, flags, out, at = [], [], [], 0
        for i in completion:
            special = i in self.special
            b = b"" if special else self.bytes[i]
            if b is None:
                raise ValueError(f"token {i} has no known bytes in the tokenizer "
                                 f"{self.tokenizer.name_or_path!r}: cannot re-tokenize its "
                                 "samples for another model")
            spans.append((at, at + len(b)))
            flags.append(special)
            out.append(b)
            at += len(b)
            if special:
                break
        return spans, flags, b"".join(out)

    def encode(self, text: str, stop: bool):
        """This side's tokens of `text` (and its end-of-turn token when `stop`)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, spans = list(enc["input_ids"]), char_to_byte_offsets(text, enc["offset_mapping"])
        flags = [i in self.special for i in ids]
        if stop:
            end = len(text.encode())
            ids, spans, flags = ids + [self.eot], spans + [(end, end)], flags + [True]
        return ids, spans, flags


class Retokenizer:
    """Aligned paired examples from sampled completions; see the module docstring."""

    def __init__(self, student_tokenizer, teacher_tokenizer, student_end_of_turn: str,
                 teacher_end_of_turn: str):
        self.student = _Side(student_tokenizer, student_end_of_turn)
        self.teacher = _Side(teacher_tokenizer, teacher_end_of_turn)

    def student_sample(self, student_prompt: list[int], completion: list[int],
                       teacher_prompt: list[int]) -> dict:
        """The student's sampled row (its prompt + completion, the completion trained) and
        the teacher's tokens of the same text."""
        src, dst = self._pair(self.student, self.teacher, student_prompt, completion,
                              teacher_prompt)
        return self._example(src, dst)

    def teacher_sample(self, teacher_prompt: list[int], completion: list[int],
                       student_prompt: list[int]) -> dict:
        """A teacher-written row: the student is trained on its own tokens of the text."""
        src, dst = self._pair(self.teacher, self.student, teacher_prompt, completion,
                              student_prompt)
        (t_ids, t_labels, t_run), (s_ids, s_labels, s_run) = src, dst
        spans = align_runs(s_run, t_run)
        return paired_example(s_ids, s_labels, t_ids, t_labels, spans)

    def _example(self, src, dst) -> dict:
        (s_ids, s_labels, s_run), (t_ids, t_labels, t_run) = src, dst
        return paired_example(s_ids, s_labels, t_ids, t_labels, align_runs(s_run, t_run))

    @staticmethod
    def _pair(src: _Side, dst: _Side, src_prompt, completion, dst_prompt):
        spans, flags, text = src.sampled(completion)
        stop = any(flags)
        string = text.decode("utf-8", errors="replace")
        d_ids, d_spans, d_flags = dst.encode(string, stop)
        src_run = Run(len(src_prompt), spans, flags, text)
        dst_run = Run(len(dst_prompt), d_spans, d_flags, string.encode())
        mask = [IGNORE_INDEX]
        return ((list(src_prompt) + list(completion),
                 mask * len(src_prompt) + list(completion), src_run),
                (list(dst_prompt) + d_ids, mask * len(dst_prompt) + d_ids, dst_run))
