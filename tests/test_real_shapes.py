"""bench/make_real_shape_models.py: the real shapes are right, and the whole script
(build, then the training CLI) runs on CPU at tiny shapes."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures import load_script

real_shapes = load_script("bench/make_real_shape_models.py")

# parameter counts (billions) of the public models whose shapes the pairs copy
PUBLIC = {"llama": (1.236, 8.030), "qwen": (0.494, 7.616), "gemma": (2.614, 9.242)}


@pytest.mark.parametrize("pair", list(PUBLIC))
def test_pairs_have_the_public_shapes(pair):
    vocab, student_cfg, teacher_cfg = real_shapes.shapes(pair, tiny=False)
    for cfg, want in zip((student_cfg, teacher_cfg), PUBLIC[pair]):
        with torch.device("meta"):  # no memory: shapes only
            model = AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in model.parameters()) / 1e9
        assert n == pytest.approx(want, rel=0.005), (pair, n)
        assert model.get_output_embeddings().weight.shape[0] >= vocab
    if pair == "gemma":
        assert student_cfg.final_logit_softcapping == teacher_cfg.final_logit_softcapping == 30


@pytest.mark.parametrize("size", [400, 151665])
def test_tokenizer_has_the_size_and_round_trips_chat(size, tmp_path):
    tok = real_shapes.make_tokenizer(size)
    tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == size
    real_shapes.make_chat_data(tmp_path / "data", 6, 1, tiny=False)
    for line in (tmp_path / "data/sft_train.jsonl").read_text().splitlines():
        text = tok.apply_chat_template(json.loads(line)["messages"], tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
        assert text.count("<|im_start|>assistant\n") >= 1


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_whole_script_runs_tiny_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "logs"))  # logs go to $OUT when it is set
    rc = real_shapes.main(["--out", str(tmp_path / "rs"), "--tiny", "--run",
                           "--pairs", "qwen"])
    assert rc == 0
    (info,) = json.loads((tmp_path / "logs/summary.json").read_text())
    assert info["student_head_rows"] > info["tokenizer_size"]  # Qwen's padded heads
    assert len(info["train_loss"]) == 5 and all(0 < v < 10 for v in info["train_loss"])
    assert info["tokens_per_s"] > 0 and info["val_loss"]
    log = (tmp_path / "logs/train_qwen.log").read_text()
    assert "+experiment=hf_sft" in log and "data.packing=true" in log
    assert "head check passed for student, teacher" in log and info["head_check"] == "passed"
    assert not (tmp_path / "rs/qwen").exists()  # model folders removed after the run
