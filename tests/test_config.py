"""The config schema: a wrong type or an out-of-range value stops the run before anything
loads, with a message naming the key, the value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

import lightning
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from distill.cache.run import cache_teacher_logits
from distill.config import ConfigError, problems, validate
from distill.lightning_version import ESCAPE, TESTED, check_lightning_version
from distill.train import train

CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# the model paths point nowhere: a ConfigError proves the check ran before any loading
NOWHERE = ["student.name_or_path=/nonexistent/student", "teacher.name_or_path=/nonexistent/t"]

# (override, the message's key words): every case of issue 13 that the schema owns
BAD = [
    ("trainer.accumulate_grad_batches=-1", "trainer.accumulate_grad_batches=-1: must be an "
     "integer >= 1"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0: must be an "
     "integer >= 1"),
    ("trainer.accumulate_grad_batches=2.5", "trainer.accumulate_grad_batches=2.5: must be an "
     "integer >= 1"),
    ("data.packing=no", "data.packing='no': must be true or false"),
    ("data.packing=1", "data.packing=1: must be true or false"),
    ("loss.temperature_squared=off", "loss.temperature_squared='off': must be true or false"),
    ("data.max_length=-1", "data.max_length=-1: must be an integer >= 2"),
    ("data.max_length=0", "data.max_length=0: must be an integer >= 2"),
    ("data.max_length=1", "data.max_length=1: must be an integer >= 2"),
    ("loss.temperature=inf", "loss.temperature=inf: must be a finite number > 0"),
    ("loss.temperature=nan", "loss.temperature=nan: must be a finite number > 0"),
    ("loss.temperature=0", "loss.temperature=0: must be a finite number > 0"),
    ("loss.temperature=-2", "loss.temperature=-2: must be a finite number > 0"),
    ("loss.temperature=abc", "loss.temperature='abc': must be a finite number > 0"),
    ("loss.temperature=true", "loss.temperature=True: must be a finite number > 0"),
    ("loss.chunk_size=-5", "loss.chunk_size=-5: must be an integer >= 1 or null"),
    ("loss.chunk_size=0", "loss.chunk_size=0: must be an integer >= 1 or null"),
    ("student.dtype=float64", "student.dtype='float64': must be one of float32, bfloat16"),
    ("teacher.dtype=fp16", "teacher.dtype='fp16': must be one of float32, bfloat16"),
    ("loss.kind=rkl", "loss.kind='rkl': must be one of forward_kl, reverse_kl, jsd"),
    ("loss.normalization=tokens", "loss.normalization='tokens': must be one of valid_tokens"),
    ("loss.sparse_mode=tails", "loss.sparse_mode='tails': must be one of tail, renormalize"),
    ("loss.ce_weight=-1", "loss.ce_weight=-1: must be a finite number >= 0"),
    ("loss.beta=1.5", "loss.beta=1.5: must be a finite number >= 0 and <= 1"),
    ("loss.fp32_weight_grad=yes", "loss.fp32_weight_grad='yes': must be true or false"),
    ("data.batch_size=0", "data.batch_size=0: must be an integer >= 1"),
    ("data.batch_size=abc", "data.batch_size='abc': must be an integer >= 1"),
    ("data.num_workers=-1", "data.num_workers=-1: must be an integer >= 0"),
    ("data.train=[]", "data.train=[]: must be a non-empty list of sources"),
    ("data.train.0.weight=0", "data.train[0].weight=0 (source 'demo_sft'): must be a finite "
     "number > 0"),
    ("data.train.0.weight=-1", "data.train[0].weight=-1 (source 'demo_sft'): must be a finite "
     "number > 0"),
    ("data.train.0.kind=chat", "data.train[0].kind='chat' (source 'demo_sft'): must be one of "
     "sft, cpt, prompts"),
    ("data.train=[{name:a,kind:sft,path:x.jsonl,max_examples:0}]",
     "data.train[0].max_examples=0 (source 'a'): must be an integer >= 1 or null"),
    ("data.assistant_turns=first", "data.assistant_turns='first': must be one of all, last"),
    ("data.cpt_stride=0", "data.cpt_stride=0: must be an integer >= 1 or null"),
    ("data.chat_template=''", "data.chat_template='': must be a non-empty string or null"),
    ("scheduler={warmup_ratio:1.5}", "scheduler.warmup_ratio=1.5: must be a finite number >= 0 "
     "and <= 1"),
    ("trainer.max_steps=0", "trainer.max_steps=0: must be an integer >= 1 or -1"),
    ("trainer.precision=bf15-mixed", "trainer.precision='bf15-mixed': must be one of 32-true"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1: must be a finite number"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0: must be an integer >= 1"),
    ("trainer.val_check_interval=1.5", "trainer.val_check_interval=1.5: must be an integer"),
    ("trainer.devices=0", "trainer.devices=0: must be 'auto', an integer >= 1 or -1"),
    ("trainer.devices=[]", "trainer.devices=[]: must be 'auto', an integer >= 1 or -1"),
    ("trainer.num_nodes=0", "trainer.num_nodes=0: must be an integer >= 1"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0: must be an integer >= 1 or -1 or null"),
    ("trainer.gradient_clip_algorithm=l2", "trainer.gradient_clip_algorithm='l2': must be one of "
     "norm, value, or null"),
    ("logger={wandb:{offline:no}}", "logger.wandb.offline='no': must be true or false"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0: must be an integer >= 1"),
    ("optimizer.lr=0", "optimizer.lr=0: must be a finite number > 0"),
    ("optimizer.lr=1e-3x", "optimizer.lr='1e-3x': must be a finite number > 0"),
    ("scheduler.num_warmup_steps=-3", "scheduler.num_warmup_steps=-3: must be an integer >= 0"),
    ("seed=abc", "seed='abc': must be an integer >= 0"),
    ("evaluate={path:x,max_new_tokens:0}", "evaluate.max_new_tokens=0: must be an integer >= 1"),
    ("student.name_or_path=''", "student.name_or_path='': must be a non-empty string"),
]


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """The mix experiment (every group), composed once; cases edit copies of it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["+experiment=mix_jsd",
                                           f"paths.output_dir={tmp_path_factory.mktemp('o')}"])


def edited(cfg, *overrides):
    """`cfg` with command-line overrides applied, values typed by Hydra's own parser (so
    `no` is the string 'no' and `inf` a float, as on the command line)."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False)
    return cfg


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_passes(experiment, compose_cfg):
    assert problems(compose_cfg(f"+experiment={experiment}")) == []


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(override, message, mix):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(edited(mix, override))


@pytest.mark.parametrize("overrides,message", [
    (["loss.divergence_weight=0", "loss.ce_weight=0"],
     "loss.divergence_weight=0 and loss.ce_weight=0: the loss is zero at every step"),
    (["loss.beta=0"], "loss.beta=0: jsd needs beta strictly inside (0, 1)"),
    (["loss.beta=1.0"], "loss.beta=1.0: jsd needs beta strictly inside (0, 1)"),
    (["trainer.max_steps=-1", "trainer.max_epochs=-1"],
     "trainer.max_steps=-1 and trainer.max_epochs=-1: the run never stops"),
], ids=["zero_loss", "jsd_beta_0", "jsd_beta_1", "never_stops"])
def test_rules_over_several_keys(overrides, message, mix):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(edited(mix, *overrides))


def test_valid_edges_pass(mix):
    cfg = edited(mix, "data.max_length=2", "loss.chunk_size=1",
                      "loss.temperature=1e-3", "loss.beta=0.999", "loss.ce_weight=0",
                      "trainer.max_steps=-1", "trainer.max_epochs=2", "loss.temperature=3",
                      "trainer.val_check_interval=0.25", "student.dtype=bfloat16",
                      "data.train.0.weight=1e-6", "loss.divergence_weight=0",
                      "loss.ce_weight=1", "ckpt_path=last", "trainer.devices='0,1'",
                      "trainer.num_nodes=2")
    assert problems(cfg) == []


def test_keys_the_schema_does_not_know_pass(compose_cfg):
    """Options other parts add (chat templates, on-policy rollouts, LoRA) need no rule here."""
    cfg = compose_cfg("+experiment=sft_rkl", "+data.chat_template=chatml",
                      "+loss.on_policy.samples=4", "+student.lora.rank=8", "+trainer.foo=1")
    assert problems(cfg) == []


def test_all_problems_are_listed_at_once(compose_cfg):
    cfg = compose_cfg("+experiment=sft_rkl", "data.packing=no", "loss.temperature=inf",
                      "trainer.accumulate_grad_batches=0")
    with pytest.raises(ConfigError, match=r"invalid config \(3 problems\)") as err:
        validate(cfg)
    for key in ("data.packing", "loss.temperature", "trainer.accumulate_grad_batches"):
        assert key in str(err.value)


def test_a_missing_mandatory_value_is_named():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["student=hf"])  # name_or_path: ???
    with pytest.raises(ConfigError, match=r"student.name_or_path is not set \(\?\?\?\)") as err:
        validate(cfg)
    assert "tokenizer cannot be resolved (MissingMandatoryValue" in str(err.value)


@pytest.mark.parametrize("override", ["data.packing=no", "trainer.accumulate_grad_batches=-1",
                                      "data.train.0.weight=0", "loss.temperature=abc"])
def test_train_stops_before_anything_loads(override, compose_cfg):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".0.", r"\[0\]\.")):
        train(compose_cfg("+experiment=mix_jsd", override, *NOWHERE))


@pytest.mark.parametrize("override,message", [
    ("cache.top_k=0", "cache.top_k=0: must be an integer >= 1"),
    ("cache.dtype=float32", "cache.dtype='float32': must be one of float16, bfloat16"),
    ("cache.shard_size=-1", "cache.shard_size=-1: must be an integer >= 1"),
    ("cache.splits=[test]", "cache.splits=['test']: must be a non-empty list of train"),
    ("loss.temperature=inf", "cache.temperature=inf: must be a finite number > 0"),
])
def test_the_caching_job_stops_before_the_teacher_loads(override, message, compose_cfg,
                                                         tmp_path):
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("cache", overrides=["+experiment=offline_fkl", override,
                                          f"cache.dir={tmp_path}/c",
                                          "cache.teacher.name_or_path=/nonexistent/t"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        cache_teacher_logits(cfg)


# --- the Lightning version -------------------------------------------------------------
def test_the_installed_lightning_is_in_the_tested_range():
    check_lightning_version()  # CI runs the pinned range: this must pass as installed
    lower, upper = TESTED
    text = Path(__file__).parents[1].joinpath("pyproject.toml").read_text()
    assert f'"lightning>={lower},<{upper}"' in text  # the pin and the check agree


@pytest.mark.parametrize("version", ["2.7.0", "3.0.1", "2.5.9"])
def test_an_untested_lightning_stops_the_run_at_start(version, compose_cfg, monkeypatch):
    monkeypatch.delenv(ESCAPE, raising=False)
    monkeypatch.setattr(lightning, "__version__", version)
    with pytest.raises(RuntimeError, match=f"lightning {version} is outside the range distill "
                       f"is tested with .*set {ESCAPE}=1"):
        train(compose_cfg("+experiment=sft_rkl", *NOWHERE))


def test_the_escape_hatch_turns_the_stop_into_a_warning(monkeypatch):
    monkeypatch.setenv(ESCAPE, "1")
    with pytest.warns(UserWarning, match="lightning 2.7.0 is outside the range"):
        check_lightning_version("2.7.0")
