"""distill-export on every checkpoint a run writes (full, LoRA as adapter or merged, an FSDP
sharded folder), the model card beside the weights, and the upload to the Hub with
huggingface_hub's calls replaced (no network here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from transformers import AutoModelForCausalLM

from distill.run.export import export, main
from distill.train import train


def _compose(tiny_assets, out, *overrides):
    from hydra import compose, initialize_config_module

    base = [f"paths.output_dir={out}", f"student.name_or_path={tiny_assets['student']}",
            f"teacher.name_or_path={tiny_assets['teacher']}",
            f"paths.data={tiny_assets['sft_train'].parent}", "evaluate=null",
            "data.batch_size=4", "trainer.max_steps=3", "trainer.val_check_interval=3",
            "trainer.log_every_n_steps=1", "callbacks.progress.refresh_rate=0",
            "+experiment=sft_fkl"]
    with initialize_config_module("distill.conf", version_base="1.3"):
        return compose("train", overrides=base + list(overrides))


def _run(tiny_assets, out, *overrides):
    """A finished run with last.ckpt and the config Hydra saves beside its outputs."""
    cfg = _compose(tiny_assets, out, *overrides)
    summary = train(cfg)
    (out / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(cfg, out / ".hydra/config.yaml")
    (out / ".hydra/overrides.yaml").write_text("- +experiment=sft_fkl\n- trainer.max_steps=3\n")
    return summary


@pytest.fixture(scope="module")
def full_run(tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, _run(tiny_assets, out)


@pytest.fixture(scope="module")
def lora_run(tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    return out, _run(tiny_assets, out, "student=hf", "student.lora.r=4",
                     "student.lora.alpha=16", "optimizer.lr=1e-2")


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def _ids(vocab):
    return torch.randint(4, vocab, (2, 11))


@pytest.mark.parametrize("merge", [False, True])
def test_lora_checkpoint_exports_as_adapter_or_merged(lora_run, tiny_assets, tmp_path, merge):
    out, summary = lora_run
    dest = tmp_path / "exported"
    main([str(out / "checkpoints/last.ckpt"), "--out", str(dest)] + (["--merge"] * merge))
    end = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_assets["student"]),
                                    summary["student_dir"])  # the end-of-run export
    ids = _ids(end.config.vocab_size)
    if merge:
        assert not (dest / "adapter_config.json").exists()
        again = AutoModelForCausalLM.from_pretrained(dest)
    else:
        assert not (dest / "model.safetensors").exists()
        base = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
        again = PeftModel.from_pretrained(base, dest)
    torch.testing.assert_close(_logits(again, ids), _logits(end, ids), rtol=1e-5, atol=1e-5)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
    assert (_logits(fresh, ids) - _logits(again, ids)).abs().max() > 1e-4  # the adapters count
    card = (dest / "README.md").read_text()
    assert "LoRA | r=4, alpha=16" in card and ("merged" in card) == merge
    assert "library_name: " + ("transformers" if merge else "peft") in card


def test_a_lora_checkpoint_away_from_its_run_says_where_its_settings_are(lora_run, tmp_path,
                                                                         tiny_assets):
    out, _ = lora_run
    lone = tmp_path / "lone" / "x.ckpt"
    lone.parent.mkdir()
    lone.write_bytes((out / "checkpoints/last.ckpt").read_bytes())
    with pytest.raises(ValueError, match=r"LoRA student .*settings \(student\.lora.*its run "
                                         r"folder"):
        export(lone, model=str(tiny_assets["student"]))


def _as_sharded(ckpt_file: Path, folder: Path) -> None:
    """The folder Lightning's FSDPStrategy writes with state_dict_type=sharded: the state
    dict and optimizer states through torch.distributed.checkpoint, the rest in meta.pt."""
    import torch.distributed.checkpoint as dcp

    ckpt = torch.load(ckpt_file, weights_only=False)
    state = {"model": ckpt.pop("state_dict")}
    state.update({f"optimizer_{i}": {"param_groups": o["param_groups"]}
                  for i, o in enumerate(ckpt.pop("optimizer_states"))})
    folder.mkdir()
    dcp.save(state, checkpoint_id=folder)
    torch.save(ckpt, folder / "meta.pt")


def test_sharded_fsdp_folder_exports_the_same_student(full_run, tmp_path):
    out, _ = full_run
    sharded = tmp_path / "checkpoints" / "last.ckpt"  # a folder, as FSDP writes it
    sharded.parent.mkdir()
    _as_sharded(out / "checkpoints/last.ckpt", sharded)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra/config.yaml").write_bytes((out / ".hydra/config.yaml").read_bytes())
    folder = export(sharded)
    assert folder == tmp_path / "student-last"
    want = AutoModelForCausalLM.from_pretrained(export(out / "checkpoints/last.ckpt",
                                                       tmp_path / "from_file")).state_dict()
    got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    assert "| optimizer steps | 3 |" in (folder / "README.md").read_text()


def test_a_folder_that_is_not_a_sharded_checkpoint_is_named(tmp_path):
    with pytest.raises(ValueError, match="folder without meta.pt"):
        export(tmp_path)


def test_non_finite_weights_are_not_exported(full_run, tmp_path):
    out, _ = full_run
    ckpt = torch.load(out / "checkpoints/last.ckpt", weights_only=False)
    key = next(k for k in ckpt["state_dict"] if k.startswith("student."))
    ckpt["state_dict"][key][0] = float("nan")
    (tmp_path / "checkpoints").mkdir()
    torch.save(ckpt, tmp_path / "checkpoints/bad.ckpt")
    with pytest.raises(ValueError, match="non-finite weights .* Export an earlier checkpoint"):
        export(tmp_path / "checkpoints/bad.ckpt", model=str(out / "student"))
    assert not (tmp_path / "student-bad").exists()


def test_model_card_of_the_end_of_run_export(full_run, tiny_assets):
    _, summary = full_run
    card = (Path(summary["student_dir"]) / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "base_model" not in card  # a local folder is no hub id
    for fact in (f"| teacher | `{tiny_assets['teacher']}` (live) |",
                 f"| student base | `{tiny_assets['student']}` |",
                 f"`demo_sft` (sft: `{tiny_assets['sft_train']}`)",
                 "kind=forward_kl", "normalization=valid_tokens", "temperature=1.0",
                 "| optimizer steps | 3 |", "| val/loss |", "| train/loss |",
                 "run in-process"):
        assert fact in card, (fact, card)


def test_export_command_writes_a_card_with_the_training_command(full_run, tmp_path):
    out, _ = full_run
    folder = export(out / "checkpoints/last.ckpt", tmp_path / "x")
    card = (folder / "README.md").read_text()
    assert "distill-train +experiment=sft_fkl trainer.max_steps=3" in card
    assert "| val/loss |" in card  # from the run's CSV logs, at the checkpoint's step
    assert f"| exported from | `{out / 'checkpoints/last.ckpt'}` |" in card


class FakeHub:
    calls: list = []

    def __init__(self, *args, **kwargs):
        pass

    def create_repo(self, repo_id, **kwargs):
        FakeHub.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        FakeHub.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        assert (Path(kwargs["folder_path"]) / "README.md").is_file()
        assert (Path(kwargs["folder_path"]) / "config.json").is_file()
        return type("Commit", (), {"commit_url": f"https://hub/{kwargs['repo_id']}/commit/1"})


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeHub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    return FakeHub.calls


def test_push_to_hub_at_the_end_of_a_run(tiny_assets, tmp_path, fake_hub):
    summary = _run(tiny_assets, tmp_path / "run", "callbacks.export.push_to_hub=me/tiny-student",
                   "trainer.max_steps=1")
    assert [c[:2] for c in fake_hub] == [("create_repo", "me/tiny-student"),
                                         ("upload_folder", "me/tiny-student")]
    assert fake_hub[1][2]["folder_path"] == summary["student_dir"]


def test_push_to_hub_from_the_export_command(full_run, tmp_path, fake_hub):
    out, _ = full_run
    main([str(out / "checkpoints/last.ckpt"), "--out", str(tmp_path / "x"), "--push-to-hub",
          "me/x"])
    assert [c[:2] for c in fake_hub] == [("create_repo", "me/x"), ("upload_folder", "me/x")]


def test_a_failed_push_keeps_the_export_and_says_how_to_retry(full_run, tmp_path, monkeypatch):
    import huggingface_hub

    class Offline(FakeHub):
        def create_repo(self, repo_id, **kwargs):
            raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    out, _ = full_run
    with pytest.raises(RuntimeError, match=r"saved in .*x, but pushing it .*'me/x' failed "
                                           r"\(ConnectionError: no network\); retry with "
                                           r"`huggingface-cli upload me/x"):
        export(out / "checkpoints/last.ckpt", tmp_path / "x", push_to_hub="me/x")
    assert (tmp_path / "x" / "model.safetensors").is_file()
