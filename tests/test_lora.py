"""LoRA students: the settings reach PEFT, a frozen head gets no gradient, both exports load
back to the trained student, and accumulation and resume behave as for full fine-tuning."""

from pathlib import Path

import lightning as L
import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from distill.models.lora import LoraConfig, load_exported, load_student

LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
RUNS: list = []  # what Probe saw, one entry per run


class Probe(L.Callback):
    """Records, at each optimizer step, which student parameters have a gradient."""

    def on_fit_start(self, trainer, pl_module):
        RUNS.append({"student": pl_module.student, "with_grad": [], "head_grads": [],
                     "train_mode": []})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        RUNS[-1]["train_mode"].append(all(m.training for m in pl_module.student.modules()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        student = pl_module.student
        RUNS[-1]["with_grad"].append({n for n, p in student.named_parameters()
                                      if p.grad is not None})
        RUNS[-1]["head_grads"].append(student.get_output_embeddings().weight.grad)


def _lora_run(compose_cfg, out, *overrides, steps=3):
    from distill.train import train  # here: the GPU test below runs without Hydra installed

    cfg = compose_cfg("+experiment=sft_fkl", "student=hf", "student.dtype=float32",
                      "student.lora.r=4", f"trainer.max_steps={steps}", "scheduler=none",
                      "optimizer.lr=1e-2", "+callbacks.probe._target_=tests.test_lora.Probe",
                      *overrides, out=out)
    summary = train(cfg)
    return summary, RUNS[-1]


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def test_settings_reach_peft(tiny_assets):
    lora = {"r": 3, "alpha": 6, "dropout": 0.25, "target_modules": ["q_proj", "v_proj"],
            "train_head": False}
    model = load_student(str(tiny_assets["student"]), lora=lora)
    wrapped = {n.rsplit(".", 1)[-1]: m for n, m in model.named_modules()
               if isinstance(m, LoraLayer)}
    assert set(wrapped) == {"q_proj", "v_proj"}
    for m in wrapped.values():
        assert m.r["default"] == 3 and m.scaling["default"] == pytest.approx(2.0)
        assert m.lora_dropout["default"].p == 0.25
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not model.get_output_embeddings().weight.requires_grad
    # the defaults: every Linear but the head, alpha = 2 r, and the head on request
    model = load_student(str(tiny_assets["student"]), lora={"r": 2, "train_head": True},
                         dtype="bfloat16")
    wrapped = {n.rsplit(".", 1)[-1]: m for n, m in model.named_modules()
               if isinstance(m, LoraLayer)}
    assert set(wrapped) == LINEARS
    assert all(m.scaling["default"] == pytest.approx(2.0) for m in wrapped.values())
    head = model.get_output_embeddings().weight
    assert head.requires_grad and head is model.get_input_embeddings().weight  # tied
    # what trains is fp32 even on a bf16 base
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert wrapped["q_proj"].base_layer.weight.dtype == torch.bfloat16
    assert not LoraConfig(r=None, alpha=4).enabled  # r=null: full fine-tuning


@pytest.mark.parametrize("lora, match", [
    ({"r": 0}, r"student.lora.r=0: must be an integer >= 1 or null \(the LoRA rank"),
    ({"r": "8"}, "lora.r='8'"),
    ({"r": 4, "alpha": -1}, "lora.alpha=-1: must be a finite number > 0"),
    ({"r": 4, "dropout": 1.0}, r"lora.dropout=1.0: must be a number in \[0, 1\)"),
    ({"r": 4, "train_head": "no"}, "lora.train_head='no': must be true or false"),
    ({"r": 4, "rank": 8}, r"student.lora.rank: unknown key"),
    ({"r": 4, "target_modules": ["lm_head"]}, "reaches the LM head.*train_head=true"),
    ({"r": 4, "target_modules": ["nope_proj"]}, "target_modules=\\['nope_proj'\\]"),
])
def test_bad_settings_are_refused(tiny_assets, lora, match):
    with pytest.raises(ValueError, match=match):
        load_student(str(tiny_assets["student"]), lora=lora)


def test_lora_on_a_random_student_is_refused(tiny_assets):
    with pytest.raises(ValueError, match="needs a pretrained student.*from_scratch"):
        load_student(str(tiny_assets["student"]), lora={"r": 4}, from_scratch=True)


@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("merge", [False, True])
def test_trains_and_exports(compose_cfg, tiny_assets, tmp_path, capsys, train_head, merge):
    summary, run = _lora_run(compose_cfg, tmp_path / "run", "student.lora.dropout=0.1",
                             f"student.lora.train_head={str(train_head).lower()}",
                             f"callbacks.export.merge={str(merge).lower()}")
    # the run's summary says how to load what it saved
    assert ("PeftModel.from_pretrained" in capsys.readouterr().out) != merge
    student = run["student"]
    assert summary["global_step"] == 3 and len(run["with_grad"]) == 3
    assert run["train_mode"] == [True] * 3  # dropout on, as configured
    head_key = "model.embed_tokens.weight"  # the tiny student ties its head to it
    for with_grad, head_grad in zip(run["with_grad"], run["head_grads"]):
        adapters = {n for n in with_grad if ".lora_" in n}
        assert adapters == {n for n, _ in student.named_parameters() if ".lora_" in n}
        assert with_grad - adapters == ({head_key} if train_head else set())
        # a frozen head: no gradient at all (the loss skipped its weight GEMM)
        assert (head_grad is None) != train_head
    base = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
    ids = torch.randint(0, base.config.vocab_size, (2, 13))
    out = Path(summary["student_dir"])
    if merge:
        assert not (out / "adapter_config.json").exists()
        again = AutoModelForCausalLM.from_pretrained(out)
    else:
        assert not (out / "model.safetensors").exists()
        saved = load_file(out / "adapter_model.safetensors")
        assert (f"base_model.model.{head_key}" in saved) == train_head
        again = PeftModel.from_pretrained(base, out)
        # what the report scores after an FSDP fit: the adapter merged onto its base
        torch.testing.assert_close(_logits(load_exported(out), ids), _logits(student, ids),
                                   rtol=1e-5, atol=1e-5)
    want = _logits(student, ids)
    torch.testing.assert_close(_logits(again, ids), want, rtol=1e-5, atol=1e-5)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
    assert (_logits(fresh, ids) - want).abs().max() > 1e-3  # training changed the student


def test_accumulation_equals_one_big_batch(compose_cfg, tmp_path):
    """One SGD step: 4 micro-batches of 2 give the same adapter as 1 batch of 8."""
    adapters = []
    for k, size in ((4, 2), (1, 8)):
        summary, _ = _lora_run(compose_cfg, tmp_path / f"k{k}", "optimizer=sgd",
                               "optimizer.lr=0.5", "trainer.gradient_clip_val=null",
                               f"trainer.accumulate_grad_batches={k}",
                               f"data.batch_size={size}", steps=1)
        adapters.append(load_file(Path(summary["student_dir"]) / "adapter_model.safetensors"))
    moved = 0
    for name, w in adapters[0].items():
        torch.testing.assert_close(w, adapters[1][name], rtol=1e-5, atol=1e-7)
        moved += "lora_B" in name and w.abs().max() > 0  # B starts at zero: it moved
    assert moved == 7


def test_resume_from_checkpoint_continues_the_same_run(compose_cfg, tmp_path):
    ckpt = ["callbacks.checkpoint.every_n_train_steps=2"]
    straight, _ = _lora_run(compose_cfg, tmp_path / "straight", *ckpt, steps=4)
    _lora_run(compose_cfg, tmp_path / "first", *ckpt, steps=2)
    last = tmp_path / "first/checkpoints/last.ckpt"
    resumed, run = _lora_run(compose_cfg, tmp_path / "resumed", *ckpt, f"ckpt_path={last}",
                             steps=4)
    assert resumed["global_step"] == 4 and len(run["with_grad"]) == 2
    a = load_file(Path(straight["student_dir"]) / "adapter_model.safetensors")
    b = load_file(Path(resumed["student_dir"]) / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7)


def test_bench_script_runs_tiny_on_cpu(tmp_path):
    """bench/bench_lora.py --tiny: the GPU benchmark's code path, in seconds on a CPU."""
    from tests.fixtures import load_script

    bench = load_script("bench/bench_lora.py")
    rows = bench.main(["--tiny", "--rank", "4", "--out", str(tmp_path)])
    full, lora, head = rows
    assert [r["mode"] for r in rows] == ["full", "lora r=4", "lora r=4+head"]
    assert all(r["steps"] == 4 and r["tokens_per_s"] > 0 for r in rows)
    student, _ = bench.SHAPES["tiny"]
    vocab, h, layers = 512, student["hidden_size"], student["num_hidden_layers"]
    # r * (in + out) per Linear, r = 4: q, k, v, o are h x h here, gate, up, down h x 2h
    per_layer = 4 * 4 * (h + h) + 3 * 4 * (h + 2 * h)
    assert lora["trainable_params"] == layers * per_layer
    assert head["trainable_params"] == lora["trainable_params"] + vocab * h  # tied head
    assert full["trainable_params"] > head["trainable_params"]
    assert "| lora r=4 |" in (tmp_path / "bench_lora.md").read_text()


@pytest.mark.parametrize("override, match", [
    ("student.lora.r=0", "student.lora.r=0: must be an integer >= 1 or null"),
    ("student.lora.alpha=-2", "student.lora.alpha=-2: must be a finite number > 0 or null"),
    ("student.lora.dropout=1", r"student.lora.dropout=1: must be a number in \[0, 1\)"),
    ("student.lora.train_head=no", "student.lora.train_head='no': must be true or false"),
    ("callbacks.export.merge=off", "callbacks.export.merge='off': must be true or false"),
])
def test_the_config_validator_checks_lora_keys_before_anything_loads(compose_cfg, override,
                                                                      match):
    from distill.run.config import ConfigError, validate

    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg("student=hf", override))


@pytest.mark.gpu
@pytest.mark.parametrize("train_head", [False, True])
def test_gpu_bf16_mixed_lora_steps(tiny_assets, train_head):
    """On CUDA (Triton loss, bf16 autocast, bf16 frozen base): the frozen head gets no
    gradient, the adapters get finite ones, and the adapters train."""
    import functools

    from torch.utils.data import DataLoader

    from distill.training.callbacks import StepTokenCounter
    from distill.training.module import DistillModule
    from distill.training.teachers import LiveTeacher

    student = load_student(str(tiny_assets["student"]), dtype="bfloat16",
                           lora={"r": 4, "train_head": train_head}).cuda()
    teacher = LiveTeacher(str(tiny_assets["teacher"]), dtype="bfloat16").cuda()
    module = DistillModule(student, teacher, loss={"kind": "jsd"},
                           optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    vocab = student.config.vocab_size
    data = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            for ids in torch.randint(0, vocab, (3, 4, 40))]
    before = {n: p.detach().clone() for n, p in student.named_parameters() if ".lora_B" in n}
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=3, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[StepTokenCounter(), Probe()])
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))
    run = RUNS[-1]
    assert all((g is None) != train_head for g in run["head_grads"])
    for with_grad in run["with_grad"]:
        assert {n for n in with_grad if ".lora_" in n} == {
            n for n, _ in student.named_parameters() if ".lora_" in n}
    for n, p in student.named_parameters():  # (Lightning moves the module back after fit)
        if ".lora_B" in n:
            assert torch.isfinite(p).all() and not torch.equal(p, before[n].to(p.device)), n


def test_readme_lora_command_runs_as_written(compose_cfg, tiny_assets, tmp_path):
    """The README's LoRA command, its placeholder folders swapped for the tiny ones."""
    from tests.readme import cpu_overrides, readme_commands

    (command,) = [c for c in readme_commands() if "student.lora.r=" in c]
    swap = {"/models/Qwen2.5-1.5B": str(tiny_assets["student"]),
            "/models/Qwen2.5-7B-Instruct": str(tiny_assets["teacher"]),
            "/data/chat": str(tiny_assets["sft_train"].parent)}
    overrides = cpu_overrides(command, swap)
    cfg = compose_cfg("+experiment=hf_sft", *overrides, "trainer.max_steps=2",
                      "trainer.val_check_interval=2", out=tmp_path / "run")
    assert cfg.student.lora.r == 16 and cfg.student.lora.target_modules[-1] == "o_proj"
    from distill.train import train

    summary = train(cfg)
    assert summary["global_step"] == 2
    assert (Path(summary["student_dir"]) / "adapter_model.safetensors").exists()
