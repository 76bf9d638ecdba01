"""Tiny assets for tests, built from configs (no downloads): a character tokenizer with a
chat template, a Llama teacher and student saved with save_pretrained, SFT and CPT data."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(path: Path, extra_chars: str = "") -> PreTrainedTokenizerFast:
    chars = string.ascii_letters + string.digits + " +=-.,?!:" + extra_chars
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(chars)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=SPECIALS[4:])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def make_model(path: Path, vocab: int, hidden: int, layers: int, seed: int, tie=False):
    import torch

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def make_data(root: Path, n_sft: int = 48, n_cpt: int = 32, seed: int = 0) -> dict:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_sft), ("val", 8), ("test", 8)):
        rows = []
        for _ in range(n):
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            prompt = "add " + f"{a}+{b}=?" + " " * rng.randint(0, 12)  # prompts of varied length
            rows.append({"messages": [{"role": "user", "content": prompt},
                                      {"role": "assistant", "content": str(a + b)}],
                         "task": "addition"})
        p = root / f"sft_{split}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[f"sft_{split}"] = p
    # the on-policy demo's layout (conf/data/tasks_demo.yaml): labelled chats and prompts
    labeled = (root / "sft_train.jsonl").read_text().splitlines()
    prompts = [json.dumps({"messages": json.loads(r)["messages"][:1]}) for r in labeled]
    for name, lines in (("labeled", labeled[:8]), ("prompts", prompts), ("val", labeled[:4]),
                        ("test", labeled[:4])):
        (root / f"tasks_{name}.jsonl").write_text("\n".join(lines) + "\n")
    for split, n in (("train", n_cpt), ("val", 6)):
        lines = [" ".join(rng.choice(["one", "two", "sum", "is", "and"]) for _ in
                          range(rng.randint(3, 12))) for _ in range(n)]
        p = root / f"cpt_{split}.txt"
        p.write_text("\n".join(lines) + "\n")
        paths[f"cpt_{split}"] = p
    return paths


def make_tiny_assets(root: Path) -> dict:
    """Everything a test run needs: {'tokenizer', 'teacher', 'student', data paths...}."""
    tok = make_tokenizer(root / "teacher")
    make_model(root / "teacher", len(tok), hidden=32, layers=2, seed=1)
    tok.save_pretrained(root / "student")
    make_model(root / "student", len(tok), hidden=16, layers=1, seed=2, tie=True)
    return {"teacher": root / "teacher", "student": root / "student",
            **make_data(root / "data")}


# --- the run's parts, built from a composed config as train() builds them ----------------
def data_from(cfg, tokenizer, **overrides):
    """The DistillDataModule of `cfg.data`, with settings replaced by `overrides`."""
    from omegaconf import OmegaConf

    from distill.data import DistillDataModule

    return DistillDataModule(tokenizer, **{**OmegaConf.to_container(cfg.data, resolve=True),
                                          **overrides})


def teacher_from(cfg):
    """The teacher of `cfg.teacher` (and `cfg.cache`), the other groups left unchecked."""
    from distill.cache.job import CacheSettings
    from distill.core.rules import parse
    from distill.run.config import plain
    from distill.training.objective import LossConfig
    from distill.training.teachers import TeacherConfig, build_teacher

    teacher = parse(TeacherConfig, plain(cfg.teacher), "teacher.")
    loss = parse(LossConfig, plain(cfg.loss), "loss.")
    cache = parse(CacheSettings, plain(cfg.cache), "cache.") if "cache" in cfg else None
    return build_teacher(teacher, cache and cache.dir, cache and cache.top_k, loss.temperature,
                         loss.sparse_mode)


def student_from(cfg):
    """The student of `cfg.student`, the other groups left unchecked."""
    from distill.core.rules import parse
    from distill.models.lora import StudentConfig, load_student
    from distill.run.config import plain

    return load_student(parse(StudentConfig, plain(cfg.student), "student."))


def child_env(**extra: str) -> dict:
    """The environment of a test's child process (torchrun, a CLI run): this checkout first
    on the path, then the PYTHONPATH the tests run under (`make test-oldest` puts the oldest
    Lightning there), one thread per process."""
    import os

    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def leave_process_group() -> None:
    """The end of a torchrun test worker: every rank waits for the others, then the gloo
    group is shut down in order. Left to the interpreter's exit, its threads were once torn
    down running (`terminate called without an active exception`, SIGABRT on one rank)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def torchrun_train(assets: dict, out: Path, *overrides: str):
    """`python -m distill.train +experiment=sft_fkl trainer=ddp` on two CPU ranks (gloo,
    torchrun) with the tiny assets; the finished process (skips without gloo)."""
    import subprocess
    import sys

    import pytest
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "distill.train", "+experiment=sft_fkl", "trainer=ddp",
           "trainer.accelerator=cpu", f"paths.output_dir={out}",
           f"student.name_or_path={assets['student']}",
           f"teacher.name_or_path={assets['teacher']}",
           f"paths.data={assets['sft_train'].parent}", "evaluate=null", "data.batch_size=4",
           "trainer.val_check_interval=1000", "callbacks.progress.refresh_rate=0", *overrides]
    return subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=child_env(),
                          capture_output=True, text=True, timeout=600)


def load_script(relative: str):
    """A script of the checkout (scripts/x.py, bench/x.py) imported as a module, by path."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
