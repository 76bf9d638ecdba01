"""What a cross-tokenizer run builds before any model loads: both tokenizers, the pairing of
their renderings (`PairEncoder`) and, once, the map of the tokens the two vocabularies
share (`VocabMap`, for the hybrid loss).

The run hands its `CrossSetup` down to the parts that change with a second tokenizer, and
they call it: the data module (`tokenize_source`, `collate`), the objective (`divergence`),
the on-policy step (`rollout`), the teacher (`teacher`). So nothing below distill.xtok
imports it."""

from __future__ import annotations

from dataclasses import dataclass

from distill.losses import linear_cross_entropy
from distill.models.tokenizers import cross_tokenizers
from distill.training.teachers import LiveTeacher
from distill.xtok.collate import PairCollator
from distill.xtok.data import pair_encoder, tokenize_pair_source
from distill.xtok.loss import cross_tokenizer_divergence
from distill.xtok.onpolicy import Retokenizer
from distill.xtok.pairing import PairEncoder
from distill.xtok.rollout import cross_rollout
from distill.xtok.teachers import CachedCrossTeacher, LiveCrossTeacher
from distill.xtok.vocab import VocabMap


@dataclass
class CrossSetup:
    student_tokenizer: object
    teacher_tokenizer: object
    pair: PairEncoder
    vocab_map: VocabMap | None
    retokenizer: Retokenizer  # on-policy: a sample re-tokenized for the other model
    collate: PairCollator

    def tokenize_source(self, ds, source: dict, max_length: int, teacher_max_length=None,
                        cpt_stride=None, num_proc=None, **_):
        """One source's rows tokenized for both models (distill.xtok.data)."""
        return tokenize_pair_source(ds, source, self.pair, max_length, teacher_max_length,
                                    cpt_stride, num_proc)

    def divergence(self, cfg, vocab: int, hs, weight, head, labels, weights, targets, ce_rows):
        """The objective's divergence on the aligned spans; `ce_rows`: per-row CE weights
        (the student's own samples get none), whose CE is taken apart, on its rows."""
        s = cfg.spec()
        loss, parts = cross_tokenizer_divergence(
            hs, weight, labels=labels, weights=weights, mode=cfg.cross_tokenizer,
            vocab_map=self.vocab_map, kind=s.kind, beta=s.beta, temperature=s.temperature,
            ce_weight=s.ce_weight if ce_rows is None else 0.0,
            temperature_squared=s.temperature_squared, divergence_weight=s.divergence_weight,
            uld_weight=cfg.uld_weight, student_vocab_size=vocab, student_head=head,
            chunk_size=cfg.chunk_size, return_components=True, **targets)
        if ce_rows is not None:
            ce = linear_cross_entropy(hs, weight, labels, weights=weights * ce_rows, head=head,
                                      vocab_size=vocab, chunk_size=cfg.chunk_size)
            loss = loss + ce
            parts = {**parts, "ce": ce.detach() / s.ce_weight}
        return loss, {"divergence": parts["divergence"], "ce": parts["ce"]}

    def rollout(self, batches, cfg, seed: int, *samplers, eos):
        """The on-policy rewrite of a window, each sample re-tokenized for the other model."""
        return cross_rollout(batches, cfg, seed, self.retokenizer, self.collate, *samplers, eos)

    def teacher(self, run):
        """The run's teacher on its own tokens of each example: live, or its cache."""
        if run.teacher.kind == "live":
            return LiveCrossTeacher(LiveTeacher.load(run.teacher), self.teacher_tokenizer)
        return CachedCrossTeacher(run.cache.dir, self.teacher_tokenizer, run.cache.top_k,
                                  run.loss.temperature)


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
                           run.data.pad_to_multiple_of or 1,  # null: decided per device
                           caps=(run.data.max_length,
                                 run.data.teacher_max_length or run.data.max_length))
    return CrossSetup(student_tok, teacher_tok, pair, vocab_map, retok, collate)
