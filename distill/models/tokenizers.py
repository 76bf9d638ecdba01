"""The one tokenizer of a run: the teacher's and the student's own compared before anything
loads, so that no run trains a student on token ids that mean something else to it.

Distillation here needs one vocabulary. Every tokenizer the config names or the model
folders hold is loaded (tokenizers are small) and compared with the teacher's: the
vocabulary and the special tokens must be the same (else token ids would mean different
things to the two models: refused, naming what differs); a student whose tokens only play
other roles (a base model's eos, its own chat template) trains on, and is exported with,
the teacher's tokenizer, and the log says so. A student folder without a tokenizer uses
the teacher's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from distill.models.causal_lm import TOKENIZER_FILES, load_tokenizer, resolve_path

log = logging.getLogger(__name__)


def has_tokenizer(name_or_path: str) -> bool:
    """Whether a local model folder holds a tokenizer (a hub name is assumed to)."""
    folder = Path(resolve_path(name_or_path))
    if not folder.is_dir():
        return True
    names = {p.name for p in folder.iterdir()}
    return bool(names & set(TOKENIZER_FILES)) or any(n.endswith(".tiktoken") for n in names)


def differences(a, b) -> tuple[list[str], list[str]]:
    """(what differs in a way that changes what token ids mean, what differs in the roles a
    tokenizer gives its tokens), in words; both empty when the tokenizers are the same."""
    refused, noted = [], []
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only = sorted(set(va.items()) ^ set(vb.items()))[:3]
        refused.append(f"the vocabularies ({len(va)} vs {len(vb)} tokens; e.g. {only})")
    sa, sb = set(a.all_special_tokens), set(b.all_special_tokens)
    if sa != sb:
        refused.append(f"the special tokens ({sorted(sa ^ sb)[:4]} in one only)")
    for role in ("eos_token", "bos_token"):
        if getattr(a, role) != getattr(b, role):
            noted.append(f"{role} {getattr(a, role)!r} vs {getattr(b, role)!r}")
    if a.chat_template and b.chat_template and a.chat_template != b.chat_template:
        noted.append("the chat templates")
    return refused, noted


def check_same_tokenizer(student_tok, teacher_tok, where: str = "the student's") -> int:
    """The shared vocabulary size; a clear error when the tokenizers differ in what token ids
    mean. Differences in roles (a base student's eos, its chat template) are logged: the run
    trains on, and the export saves, the teacher's."""
    refused, noted = differences(student_tok, teacher_tok)
    if refused:
        raise ValueError(
            f"{where} tokenizer and the teacher's differ in {' and '.join(refused)}: "
            "distillation needs one vocabulary, and token ids would mean different tokens "
            "to the two models. Distil between models that share a tokenizer (a student of "
            "the teacher's family), or use cross-tokenizer distillation "
            "(loss.cross_tokenizer=hybrid)")
    if noted:
        log.warning("%s tokenizer and the teacher's share the vocabulary but differ in %s: the "
                    "run renders the data with, and the export saves, the teacher's tokenizer",
                    where, ", ".join(noted))
    return len(teacher_tok)


def run_tokenizer(student_cfg, teacher_cfg):
    """The teacher's tokenizer, after every student tokenizer there is was compared with it."""
    teacher = load_tokenizer(teacher_cfg.tokenizer_path, who="teacher")
    named = [(student_cfg.tokenizer, "student.tokenizer's")] if student_cfg.tokenizer else []
    if has_tokenizer(student_cfg.name_or_path):
        named.append((student_cfg.name_or_path, f"the student's ({student_cfg.name_or_path})"))
    for path, where in named:
        check_same_tokenizer(load_tokenizer(path), teacher, where)
    return teacher


def cross_tokenizers(student_cfg, teacher_cfg):
    """A cross-tokenizer run's two tokenizers: the student's own (student.tokenizer, or its
    folder's) and the teacher's (teacher.tokenizer, or its folder's)."""
    path = student_cfg.tokenizer or student_cfg.name_or_path
    if not student_cfg.tokenizer and not has_tokenizer(student_cfg.name_or_path):
        raise FileNotFoundError(
            f"loss.cross_tokenizer trains the student on its own tokens, and the student "
            f"folder {student_cfg.name_or_path} has no tokenizer: set student.tokenizer=<the "
            "student's tokenizer folder or hub name>")
    return load_tokenizer(path), load_tokenizer(teacher_cfg.tokenizer_path)
