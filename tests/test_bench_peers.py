"""bench/bench_peers.py (distill beside TRL, docs/peers.md): its rows, its verdicts, the
StepTimer driven by transformers' hooks, the GPU command's distill overrides, and the tiny
command of docs/peers.md run end to end (needs TRL: `pip install -e .[bench]`)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures import child_env

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "peers.md"


def doc_command(flag: str) -> list[str]:
    """The docs/peers.md command line of bench_peers.py that has `flag`, as words."""
    lines = re.findall(r"^python bench/bench_peers\.py[^\n]*", DOC.read_text(), flags=re.M)
    found = [shlex.split(line, comments=True) for line in lines if flag in line.split()]
    assert len(found) == 1, lines
    return found[0]


def rendered(tok, messages, prompt: bool) -> int:
    """Token count through the tokenizer's own chat path (not the bench's text + encode)."""
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_rows_have_the_token_lengths_the_job_asks_for(tmp_path):
    from bench import bench_peers as peers
    from bench.make_real_shape_models import make_tokenizer

    tok = make_tokenizer(400)
    job = peers.TINY
    on = peers.write_rows(tok, tmp_path / "on", job, "onpolicy")
    off = peers.write_rows(tok, tmp_path / "off", job, "offpolicy")
    on_rows = [json.loads(x)["messages"] for x in (tmp_path / "on/sft_train.jsonl").open()]
    off_rows = [json.loads(x)["messages"] for x in (tmp_path / "off/sft_train.jsonl").open()]
    # a step's rows and one step more
    assert len(on_rows) == (job.steps + 1) * job.on_batch * job.on_accum == on["rows"]
    assert len(off_rows) == (job.steps + 1) * job.off_batch * job.off_accum == off["rows"]
    assert {rendered(tok, r[:1], True) for r in on_rows} == {job.prompt_tokens}
    lengths = [rendered(tok, r, False) for r in off_rows]
    assert lengths == off["lengths"]
    assert min(lengths) >= job.max_length // 2 and max(lengths) <= job.max_length
    assert len(set(lengths)) > 1  # spread, not one length


def test_rows_refuse_a_tokenizer_they_cannot_count_for():
    """Spaces merged into the words (a whitespace pre-tokenizer): the lengths come out
    wrong, and the bench says so instead of measuring other rows than it reports."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bench import bench_peers as peers
    vocab = {t: i for i, t in enumerate(["<unk>", "<pad>", *"abcdefghijklmnopqrstuvwxyz.:"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="is not one of bench/make_real_shape_models'"):
        peers.fitted(tok, random.Random(0), 64, 200)


@pytest.mark.parametrize("ours, theirs, target, want", [
    # the one-off measurement (llama): 4.76 s / 0.79 s = 6.03x
    ((0.79, 56.9), (4.76, 59.4), (5.0, None), "met"),
    ((0.90, 47.4), (1.58, 86.6), (1.75, 0.60), "met"),  # 1.756x at 0.547 of the memory
    ((0.90, 53.0), (1.58, 86.6), (1.75, 0.60), "missed"),  # 0.612 of the memory
    ((0.92, 47.4), (1.58, 86.6), (1.75, 0.60), "missed"),  # 1.717x
    ((1.00, 10.0), (4.99, 10.0), (5.0, None), "missed"),
])
def test_comparison_against_the_targets(ours, theirs, target, want, monkeypatch):
    from bench import bench_peers as peers
    monkeypatch.setitem(peers.TARGETS, "onpolicy", target)
    runs = {"onpolicy_distill": {"median_ms": ours[0] * 1000, "peak_allocated_gib": ours[1]},
            "onpolicy_trl": {"median_ms": theirs[0] * 1000, "peak_allocated_gib": theirs[1]}}
    got = peers.comparison(runs, "onpolicy")
    assert got["verdict"] == want
    assert got["speedup"] == pytest.approx(theirs[0] / ours[0])
    assert got["memory_fraction"] == pytest.approx(ours[1] / theirs[1])


def test_a_missing_measurement_is_never_met():
    from bench import bench_peers as peers
    assert peers.verdict(None, None, (5.0, None)) == "not measured"
    assert peers.verdict(2.0, None, (1.75, 0.6)) == "memory not measured"
    runs = {"offpolicy_distill": {"median_ms": 900.0}, "offpolicy_trl": {"rc": 124}}
    assert peers.comparison(runs, "offpolicy")["verdict"] == "not measured"


def test_the_step_timer_on_transformers_hooks(tmp_path):
    """StepTimer fed by a transformers Trainer: one record per optimizer step, each with the
    real tokens of its micro-batches (rows read in order, so they are known beforehand)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from bench import peers_trl as trl_side
    lengths = [5, 9, 3, 7, 8, 2, 6, 4, 9, 9, 1, 5]  # 3 steps of 2 micro-batches of 2 rows
    rows = [{"input_ids": list(range(1, n + 1))} for n in lengths]

    def collate(batch):
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, :len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    timer = trl_side.HFStepTimer(str(tmp_path / "timer.json"), warmup=1)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True,
                             train_sampling_strategy="sequential", remove_unused_columns=False,
                             include_num_input_tokens_seen="non_padding")
    Trainer(model=model, args=args, train_dataset=rows, data_collator=collate,
            callbacks=[timer]).train()
    got = json.loads((tmp_path / "timer.json").read_text())
    assert got["steps"] == 3 and len(got["ms"]) == 3 and all(ms > 0 for ms in got["ms"])
    assert got["tokens"] == [24, 20, 24]  # 5+9+3+7, 8+2+6+4, 9+9+1+5
    assert got["median_tokens"] == 22  # the two steps after the warm-up


def test_the_gpu_commands_distill_runs_are_valid_configs(tmp_path):
    """The docs' GPU command, dry: each distill run's overrides compose and pass every check
    (trainer=auto takes this machine's CPU), with the job's settings."""
    from hydra import compose, initialize_config_module

    import distill.train  # noqa: F401  (the resolvers)
    from bench import bench_peers as peers
    from distill.run.config import parse
    words = doc_command("--budget-s")
    args = words[2:] + ["--dry-run", "--out", str(tmp_path / "out"),
                        "--root", str(tmp_path / "root")]
    assert peers.main(args) == 0
    result = json.loads((tmp_path / "out/peers.json").read_text())
    assert list(result) == ["llama", "qwen3"]
    for pair in result.values():
        commands = {name: r["command"] for name, r in pair["runs"].items()}
        assert "--trainer" in commands["onpolicy_trl"] and "gkd" in commands["offpolicy_trl"]
        for kind, rows, accum in (("onpolicy", 8, 4), ("offpolicy", 4, 4)):
            cmd = commands[f"{kind}_distill"]
            assert cmd[1:3] == ["-m", "distill.train"]
            with initialize_config_module("distill.conf", version_base="1.3"):
                run = parse(compose("train", overrides=cmd[3:]))
            assert (run.loss.kind, run.loss.beta, run.loss.temperature) == ("jsd", 0.5, 1.0)
            assert (run.data.batch_size, run.data.shuffle, run.data.packing) == \
                (rows, False, False)
            assert run.trainer["accumulate_grad_batches"] == accum
            assert run.speed.gradient_checkpointing is False
            assert (run.student.dtype, run.teacher.dtype) == ("float32", "bfloat16")
            on = run.loss.on_policy
            want = (1.0, 128, 1.0) if kind == "onpolicy" else (0.0, on.max_new_tokens, 1.0)
            assert (on.fraction, on.max_new_tokens, on.temperature) == want


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is not installed: pip install -e .[bench] (bench-only)")
def test_the_tiny_command_of_the_docs_runs_all_four_trainers(tmp_path):
    words = doc_command("--tiny")
    i = words.index("--out")
    words[i + 1] = str(tmp_path / "out")
    cmd = [sys.executable, *words[1:], "--root", str(tmp_path / "root"), "--keep"]
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out/peers.json").read_text())
    from bench import bench_peers as peers
    job = peers.TINY
    for pair, got in result.items():
        runs = got["runs"]
        assert all(r["steps"] == job.steps for r in runs.values()), pair
        # off-policy: both trained on the same rows, step by step (the rows' own lengths)
        per_step = job.off_batch * job.off_accum
        lengths = got["build"]["offpolicy_rows"]["lengths"]
        want = [sum(lengths[s * per_step:(s + 1) * per_step]) for s in range(job.steps)]
        assert runs["offpolicy_distill"]["tokens"] == want
        assert runs["offpolicy_trl"]["tokens"] == want
        # on-policy: every prompt whole, answers of at most new_tokens (an early end is fine)
        rows = job.on_batch * job.on_accum
        for who in ("distill", "trl"):
            for tokens in runs[f"onpolicy_{who}"]["tokens"]:
                assert rows * (job.prompt_tokens + 1) <= tokens
                assert tokens <= rows * (job.prompt_tokens + job.new_tokens)
        for kind in ("onpolicy", "offpolicy"):
            setup = runs[f"{kind}_trl"]["setup"]
            assert setup["student_dtype"] == "torch.float32"
            assert setup["gradient_checkpointing"] is False
        assert f"{pair}: {peers.PAIRS[pair]}" in done.stdout
        assert "| off-policy | TRL GKDTrainer (lmbda 0) |" in done.stdout
