"""What each token id *is* as text, and the map between two vocabularies built from it.

Two tokenizers spell tokens differently (byte-level BPE writes a space as "Ġ", SentencePiece
as "▁"), so tokens are compared by the bytes they decode to, not by their vocabulary
strings. Special (control) tokens are compared by their content and only with special
tokens: a teacher's "<|im_end|>" control token is not the student's text "<|im_end|>".
Control tokens that play the same role under different names (ChatML's "<|im_end|>" and
Llama-3's "<|eot_id|>" both end an assistant turn) are paired explicitly (`equivalent`).

The map is a partial bijection: when a vocabulary holds several ids with the same bytes (an
added token that repeats a merge, byte fallback "<0x41>" beside "A"), the k-th of them (in
id order) pairs with the k-th of the other side's, so that a tokenizer maps onto itself as
the identity.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """The printable character GPT-2-style byte-level BPE writes for each byte (and back)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:  # bytes without a printable form are shifted past 255
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer: cross-tokenizer "
                        "distillation needs offsets (use_fast=True)")
    spec = json.loads(backend.to_str()).get("decoder") or {}
    todo, types = [spec], set()
    while todo:
        d = todo.pop()
        types.add(d.get("type"))
        todo.extend(d.get("decoders") or [])
    return types


def special_ids(tokenizer) -> set[int]:
    """Control tokens: the declared special tokens and added tokens marked special."""
    return set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each id (0 .. len(tokenizer) - 1) decodes to; None where unknown.

    Byte-level BPE (Llama-3, Qwen2, GPT-2): exact, from the byte alphabet. Metaspace /
    SentencePiece-style (Llama-2, Mistral, Gemma): "▁" is a space and "<0xHH>" byte
    fallback is that byte. Models without a decoder (character or word vocabularies):
    the token string itself. Control tokens get their content, and are kept apart by
    `VocabMap` (they never match a text token).
    """
    types = _decoder_types(tokenizer)
    byte_level = "ByteLevel" in types
    metaspace = bool(types & {"Metaspace", "Replace"})
    fallback = "ByteFallback" in types
    alphabet = _byte_level_alphabet() if byte_level else {}
    vocab = tokenizer.get_vocab()
    out: list[bytes | None] = [None] * len(tokenizer)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    for piece, i in vocab.items():
        if i >= len(out):
            continue
        if i in added:
            out[i] = added[i].encode()
        elif byte_level:
            try:
                out[i] = bytes(alphabet[c] for c in piece)
            except KeyError:
                out[i] = None
        elif fallback and _BYTE_FALLBACK.match(piece):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = (piece.replace("\u2581", " ") if metaspace else piece).encode()
    return out


def _known_id(tokenizer, token: str) -> int | None:
    i = tokenizer.convert_tokens_to_ids(token)
    if i is None or (i == tokenizer.unk_token_id and token != tokenizer.unk_token):
        return None
    return i


@dataclass
class VocabMap:
    """Pairs (student id, teacher id) of tokens that are the same text, built once.

    `student_ids[k]` and `teacher_ids[k]` are pair k. `student_size` / `teacher_size` are
    the vocabularies the loss works over (len(tokenizer): LM-head padding rows excluded).
    """

    student_ids: torch.Tensor  # (M,) int64
    teacher_ids: torch.Tensor  # (M,) int64
    student_size: int
    teacher_size: int
    _tables: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        s, t = self.student_ids, self.teacher_ids
        if s.shape != t.shape or s.dim() != 1:
            raise ValueError("VocabMap: student_ids and teacher_ids must be 1-d of one length")
        for name, ids, size in (("student", s, self.student_size),
                                ("teacher", t, self.teacher_size)):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= size):
                raise ValueError(f"VocabMap: a {name} id is outside its vocabulary of {size}")
            if len(torch.unique(ids)) != len(ids):
                raise ValueError(f"VocabMap: a {name} id appears in two pairs; the map must "
                                 "be one-to-one")

    @classmethod
    def identity(cls, size: int) -> VocabMap:
        ids = torch.arange(size)
        return cls(ids, ids.clone(), size, size)

    @classmethod
    def build(cls, student_tokenizer, teacher_tokenizer,
              equivalent: list[tuple[str, str]] | None = None) -> VocabMap:
        """Match the two vocabularies by decoded bytes; `equivalent` adds pairs of control
        tokens (student token string, teacher token string) that play the same role."""
        pairs: dict[int, int] = {}
        keys = []
        for tok in (student_tokenizer, teacher_tokenizer):
            specials, ranked, seen = special_ids(tok), {}, {}
            for i, b in enumerate(token_bytes(tok)):
                if b is not None:
                    key = (i in specials, b)
                    seen[key] = seen.get(key, -1) + 1
                    ranked[(*key, seen[key])] = i
            keys.append(ranked)
        for key, s in keys[0].items():
            t = keys[1].get(key)
            if t is not None:
                pairs[s] = t
        for s_str, t_str in equivalent or []:
            s, t = _known_id(student_tokenizer, s_str), _known_id(teacher_tokenizer, t_str)
            if s is None or t is None:
                raise ValueError(f"VocabMap: equivalent pair ({s_str!r}, {t_str!r}) names a "
                                 "token one of the tokenizers does not have")
            for k in [k for k, v in pairs.items() if v == t]:  # keep the map one-to-one
                del pairs[k]
            pairs[s] = t
        s_ids = torch.tensor(sorted(pairs), dtype=torch.long)
        t_ids = torch.tensor([pairs[k] for k in sorted(pairs)], dtype=torch.long)
        return cls(s_ids, t_ids, len(student_tokenizer), len(teacher_tokenizer))

    def __len__(self) -> int:
        return len(self.student_ids)

    @property
    def is_identity(self) -> bool:
        return (self.student_size == self.teacher_size == len(self)
                and bool((self.student_ids == self.teacher_ids).all()))

    def tables(self, device) -> MapTables:
        """The map as index tensors on `device`, built once per device."""
        key = str(device)
        if key not in self._tables:
            ms, mt = self.student_ids.to(device), self.teacher_ids.to(device)
            pos = torch.arange(len(ms), device=device)
            pair_s = torch.full((self.student_size,), -1, dtype=torch.long, device=device)
            pair_t = torch.full((self.teacher_size,), -1, dtype=torch.long, device=device)
            pair_s.index_copy_(0, ms, pos)
            pair_t.index_copy_(0, mt, pos)
            self._tables[key] = MapTables(ms, mt, pair_s, pair_t,
                                          (pair_s < 0).nonzero().squeeze(1),
                                          (pair_t < 0).nonzero().squeeze(1))
        return self._tables[key]


@dataclass(frozen=True)
class MapTables:
    student_ids: torch.Tensor  # (M,) the student token of each pair
    teacher_ids: torch.Tensor  # (M,)
    pair_of_student: torch.Tensor  # (Vs,) the pair a student token is in, or -1
    pair_of_teacher: torch.Tensor  # (Vt,)
    unpaired_student: torch.Tensor  # (Rs,) student tokens in no pair
    unpaired_teacher: torch.Tensor  # (Rt,)
