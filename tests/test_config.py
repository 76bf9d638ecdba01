"""The config schema: a wrong type, an out-of-range value or an unknown key stops the run
before anything loads, with a message naming the key, the value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from distill.run.cache import cache_teacher_logits
from distill.run.config import ConfigError, problems, validate
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
    ("scheduler={_target_:distill.training.optim.cosine_with_warmup,_partial_:true,warmup_ratio:1.5}",
     "scheduler.warmup_ratio=1.5: must be a number in [0, 1)"),
    ("scheduler={_target_:distill.training.optim.cosine_with_warmup,_partial_:true,warmup_ratio:1}",
     "scheduler.warmup_ratio=1: must be a number in [0, 1)"),
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
    ("logger={wandb:{_target_:lightning.pytorch.loggers.WandbLogger,offline:no}}",
     "logger.wandb.offline='no': must be true or false"),
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


@pytest.mark.parametrize("override,message", [
    ("+loss.knd=forward_kl", "loss.knd: unknown key (did you mean loss.kind?)"),
    ("+loss.temprature=2", "loss.temprature: unknown key (did you mean loss.temperature?)"),
    ("+student.lora.rank=8", "student.lora.rank: unknown key"),
    ("+loss.on_policy.samples=4", "loss.on_policy.samples: unknown key"),
    ("+data.chat_templat=x", "data.chat_templat: unknown key (did you mean data.chat_template?)"),
    ("+trainer.max_step=3", "trainer.max_step: unknown key (did you mean trainer.max_steps?)"),
    ("+optimizer.weight_dacay=0.1", "optimizer.weight_dacay: unknown key (did you mean "
     "optimizer.weight_decay?)"),
    ("+callbacks.export.merg=true", "callbacks.export.merg: unknown key (did you mean "
     "callbacks.export.merge?)"),
    ("+tokenizer=x", "tokenizer: this key is gone: use student.tokenizer and "
     "teacher.tokenizer"),
    ("+data.train.0.wieght=2", "data.train[0].wieght: unknown key (did you mean "
     "data.train[0].weight?)"),
])
def test_an_unknown_key_is_refused_with_the_nearest_known_one(override, message, compose_cfg):
    """`+` additions included: Hydra itself suggests the `+` form for a key it does not know,
    and a misspelt option must never run as if it were not there."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose_cfg("+experiment=sft_rkl", override))


def test_all_problems_are_listed_at_once(compose_cfg):
    cfg = compose_cfg("+experiment=sft_rkl", "data.packing=no", "loss.temperature=inf",
                      "trainer.accumulate_grad_batches=0")
    with pytest.raises(ConfigError, match=r"invalid config \(3 problems\)") as err:
        validate(cfg)
    for key in ("data.packing", "loss.temperature", "trainer.accumulate_grad_batches"):
        assert key in str(err.value)


def test_a_missing_mandatory_value_is_named():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["student=hf", "teacher=hf"])  # name_or_path: ???
    with pytest.raises(ConfigError, match=r"student.name_or_path is not set \(\?\?\?\)") as err:
        validate(cfg)
    assert "teacher.name_or_path is not set (???)" in str(err.value)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["data.batch_size=${nowhere}"])
    with pytest.raises(ConfigError, match=r"data.batch_size cannot be resolved \(Interpolation"):
        validate(cfg)


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
        cfg = compose("train", overrides=["+experiment=offline_fkl", override,
                                          f"cache.dir={tmp_path}/c",
                                          "teacher.name_or_path=/nonexistent/t"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        cache_teacher_logits(cfg)


# --- public Lightning API only ---------------------------------------------------------
def test_lightning_is_not_pinned_to_a_minor_release():
    text = Path(__file__).parents[1].joinpath("pyproject.toml").read_text()
    pins = re.findall(r'"lightning([^"]*)"', text)
    assert pins and all("<" not in p for p in pins), pins  # the oldest supported, no ceiling


def test_no_private_attribute_of_lightning_fabric_or_liger_is_read():
    """The package reads Lightning only through its public API: no `_name` imported from
    lightning / liger_kernel, no `._name` read on a trainer, strategy, loop or loader."""
    import ast

    found = []
    for path in sorted((Path(__file__).parents[1] / "distill").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    ("lightning", "liger_kernel")):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__"):
                base = ast.unparse(node.value)
                if any(w in base for w in ("trainer", "strategy", "fit_loop", "loop",
                                           "loader", "fetcher")):
                    found.append(f"{path.name}:{node.lineno}: {base}.{node.attr}")
    assert found == []
