"""Cross-tokenizer distillation: any teacher into any student (issue 22).

The student keeps its own tokenization, labels and normalization; the teacher runs on its
own tokens of the same text; the two are compared on spans of text whose token boundaries
coincide (`align`, `pairing`), with ULD or the hybrid loss (`loss`, `span_math`), chunk
by chunk from hidden states and LM heads (`op`).
"""

from distill.xtok.align import AlignmentError
from distill.xtok.collate import PairCollator, flat_spans, teacher_targets
from distill.xtok.loss import cross_tokenizer_divergence
from distill.xtok.pairing import PairEncoder, truncate
from distill.xtok.vocab import VocabMap, token_bytes

__all__ = ["AlignmentError", "PairCollator", "PairEncoder", "VocabMap",
           "cross_tokenizer_divergence", "flat_spans", "teacher_targets", "token_bytes",
           "truncate"]
