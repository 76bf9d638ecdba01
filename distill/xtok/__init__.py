"""Cross-tokenizer distillation: any teacher into any student (issue 22).

The student keeps its own tokenization, labels and normalization; the teacher runs on its
own tokens of the same text; the two are compared on spans of text whose token boundaries
coincide (`align`, `pairing`), with ULD or the hybrid loss (`loss`, `span_math`), chunk
by chunk from hidden states and LM heads (`op`). docs/cross_tokenizer.md has the design.

Names are imported on first use, so the loss (`distill.xtok.loss`) loads without the data
stack (`datasets`), e.g. on a benchmark machine.
"""

import importlib

_WHERE = {
    "AlignmentError": "align",
    "PairCollator": "collate", "flat_spans": "collate", "teacher_targets": "collate",
    "cross_tokenizer_divergence": "loss",
    "PairEncoder": "pairing", "truncate": "pairing",
    "VocabMap": "vocab", "token_bytes": "vocab",
    "LiveCrossTeacher": "teachers", "CachedCrossTeacher": "teachers",
    "Retokenizer": "onpolicy",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'distill.xtok' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distill.xtok.{_WHERE[name]}"), name)
