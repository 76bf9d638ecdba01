"""scripts/export_checkpoint.py: any Lightning checkpoint of a run -> a Hugging Face folder."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.train import train
from tests.fixtures import load_script

ROOT = Path(__file__).resolve().parents[1]
export_checkpoint = load_script("scripts/export_checkpoint.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_assets):
    """A 4-step run with a step-2 checkpoint and last.ckpt (step 4), and Hydra's saved config."""
    from hydra import compose, initialize_config_dir

    out = tmp_path_factory.mktemp("run")
    overrides = [f"paths.output_dir={out}", f"student.name_or_path={tiny_assets['student']}",
                 f"teacher.name_or_path={tiny_assets['teacher']}",
                 f"paths.data={tiny_assets['sft_train'].parent}", "evaluate=null",
                 "data.batch_size=4", "trainer.max_steps=4", "callbacks.progress.refresh_rate=0",
                 "callbacks.checkpoint.every_n_train_steps=2", "callbacks.checkpoint.save_top_k=-1",
                 "+experiment=sft_fkl"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    summary = train(cfg)
    (out / ".hydra").mkdir(exist_ok=True)  # what @hydra.main writes beside the outputs
    OmegaConf.save(cfg, out / ".hydra/config.yaml")
    return out, summary


def _ckpt_student(path):
    state = torch.load(path, weights_only=False)["state_dict"]
    return {k.removeprefix("student."): v for k, v in state.items() if k.startswith("student.")}


def test_last_checkpoint_exports_like_the_end_of_run_student(run):
    out, summary = run
    folder = export_checkpoint.export(out / "checkpoints/last.ckpt")  # config from .hydra
    assert folder == out / "student-last"
    model = AutoModelForCausalLM.from_pretrained(folder)
    end = AutoModelForCausalLM.from_pretrained(summary["student_dir"])
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, end(ids).logits, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == \
        AutoTokenizer.from_pretrained(summary["student_dir"]).get_vocab()
    # tied embeddings stay tied after the round trip
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_step_checkpoint_exports_its_own_weights(run, tiny_assets, tmp_path):
    out, _ = run
    ckpt = next((out / "checkpoints").glob("*step=2*.ckpt"))
    dest = tmp_path / "step2"
    export_checkpoint.main([str(ckpt), "--out", str(dest), "--model",
                            str(tiny_assets["student"]), "--tokenizer",
                            str(tiny_assets["teacher"]), "--dtype", "bfloat16"])
    model = AutoModelForCausalLM.from_pretrained(dest, dtype="auto")
    assert model.dtype == torch.bfloat16
    want = _ckpt_student(ckpt)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, want[name].to(torch.bfloat16), rtol=0, atol=0)
    last = _ckpt_student(out / "checkpoints/last.ckpt")
    assert any(not torch.equal(want[k], last[k]) for k in want)  # step 2 is not step 4


def test_export_errors(run, tmp_path):
    out, _ = run
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint.export(tmp_path / "nope.ckpt")
    lone = tmp_path / "lone" / "x.ckpt"
    lone.parent.mkdir()
    lone.write_bytes((out / "checkpoints/last.ckpt").read_bytes())
    with pytest.raises(ValueError, match="no run config next to .* pass --model"):
        export_checkpoint.export(lone)
    torch.save({"state_dict": {"teacher.w": torch.zeros(1)}}, tmp_path / "t.ckpt")
    with pytest.raises(ValueError, match="holds no student weights"):
        export_checkpoint.export(tmp_path / "t.ckpt")
