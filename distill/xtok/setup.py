"""What a cross-tokenizer run builds before any model loads: both tokenizers, the pairing of
their renderings (`PairEncoder`) and, once, the map of the tokens the two vocabularies
share (`VocabMap`, for the hybrid loss)."""

from __future__ import annotations

from dataclasses import dataclass

from distill.tokenizers import cross_tokenizers
from distill.xtok.collate import PairCollator
from distill.xtok.data import pair_encoder
from distill.xtok.onpolicy import Retokenizer
from distill.xtok.pairing import PairEncoder
from distill.xtok.vocab import VocabMap


@dataclass
class CrossSetup:
    student_tokenizer: object
    teacher_tokenizer: object
    pair: PairEncoder
    vocab_map: VocabMap | None
    retokenizer: Retokenizer  # on-policy: a sample re-tokenized for the other model
    collate: PairCollator


def cross_setup(run, with_offsets: bool = False) -> CrossSetup:
    """`with_offsets`: keep each teacher token's byte range (what the teacher cache records)."""
    student_tok, teacher_tok = cross_tokenizers(run.student, run.teacher)
    pair = pair_encoder(student_tok, teacher_tok, run.data)
    pair.with_offsets = with_offsets
    equivalents = pair.special_equivalents()  # the two end-of-turn tokens, among others
    vocab_map = None
    if run.loss.cross_tokenizer == "hybrid":
        vocab_map = VocabMap.build(student_tok, teacher_tok, equivalents)
    s_eot, t_eot = equivalents[-1] if equivalents else (student_tok.eos_token,
                                                        teacher_tok.eos_token)
    retok = Retokenizer(student_tok, teacher_tok, s_eot, t_eot)
    collate = PairCollator(student_tok.pad_token_id, teacher_tok.pad_token_id,
                           run.data.pad_to_multiple_of)
    return CrossSetup(student_tok, teacher_tok, pair, vocab_map, retok, collate)
