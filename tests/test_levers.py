"""The performance switches (distill/models/levers.py) and the step benchmark's CPU path."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distill.core.rules import parse
from distill.models.causal_lm import final_hidden_states
from distill.models.levers import Speed, apply_levers, decoder_layers

ROOT = Path(__file__).resolve().parents[1]


def tiny_llama(seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=40,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).double().train()


def hidden_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    hidden = final_hidden_states(model, ids)
    (hidden.square() * torch.linspace(-1, 2, hidden.shape[-1], dtype=hidden.dtype)).sum() \
        .backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}  # the LM head is not used here


def test_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"speed.complie: unknown key \(did you mean "
                       r"speed.compile\?\)"):
        parse(Speed, {"complie": True}, "speed.")
    with pytest.raises(ValueError, match="speed.compile='no': must be true or false"):
        parse(Speed, {"compile": "no"}, "speed.")
    with pytest.raises(ValueError, match="speed.attention='flash': must be one of sdpa"):
        parse(Speed, {"attention": "flash"}, "speed.")
    assert parse(Speed, None, "speed.").active() == []
    assert parse(Speed, {"gradient_checkpointing": True, "attention": "eager"},
                 "speed.").active() == ["gradient_checkpointing", "attention=eager"]


def test_compile_with_liger_is_refused_before_anything_loads(compose_cfg):
    from distill.run.config import ConfigError, validate

    with pytest.raises(ConfigError, match="speed.compile=true with speed.liger=true: Liger's "
                       "autograd Functions inside a compiled decoder layer stop dynamo"):
        validate(compose_cfg("+experiment=sft_rkl", "speed.compile=true", "speed.liger=true"))


FSDP_CPU = ("trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true",
            "trainer.devices=2")


def test_compile_under_fsdp_with_flex_attention_is_refused_before_anything_loads(
        compose_cfg, monkeypatch):
    """Measured on the H200: FSDP + speed.compile + flex_attention stops at the first step in
    inductor (LoweringException: the GQA ratio is symbolic). flex_attention is what packed
    rows get on CUDA without flash-attn, so the rule follows that choice; FSDP with compile
    and another attention, and compile with flex_attention without FSDP, are not refused."""
    from distill.run.config import ConfigError, validate

    refusal = ("speed.compile=true under FSDP with flex_attention .* inductor fails to lower "
               "flex_attention .* set speed.compile=false")
    base = ("+experiment=sft_rkl", "speed.compile=true")
    with pytest.raises(ConfigError, match=refusal):
        validate(compose_cfg(*base, *FSDP_CPU, "speed.attention=flex_attention"))
    with pytest.raises(ConfigError, match=refusal):  # the models' own setting
        validate(compose_cfg(*base, *FSDP_CPU, "student.attn_implementation=flex_attention"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=refusal):  # packed rows on CUDA choose it
        validate(compose_cfg(*base, *FSDP_CPU, "data.packing=true"))
    # speed.attention wins over the models' own; no FSDP; compile off; unpacked rows
    for ok in [(*base, *FSDP_CPU, "speed.attention=sdpa", "data.packing=true",
                "student.attn_implementation=flex_attention"),
               (*base, "speed.attention=flex_attention", "data.packing=true"),
               ("+experiment=sft_rkl", *FSDP_CPU, "speed.attention=flex_attention"),
               (*base, *FSDP_CPU, "data.packing=false"),
               # DDP whose settings mention fsdp; a cached teacher's setting (no model runs)
               (*base, "speed.attention=flex_attention", "trainer.accelerator=cpu",
                "trainer.strategy={_target_:lightning.pytorch.strategies.DDPStrategy,"
                "process_group_backend:not_fsdp}"),
               (*base, *FSDP_CPU, "teacher=cached", "cache.dir=.", "cache.top_k=4",
                "teacher.attn_implementation=flex_attention")]:
        validate(compose_cfg(*ok))


def test_gradient_checkpointing_recomputes_and_keeps_every_gradient():
    plain, ckpt = tiny_llama(), tiny_llama()
    teacher = tiny_llama(seed=1)
    assert apply_levers(Speed(gradient_checkpointing=True), ckpt, teacher) \
        == ["gradient_checkpointing"]
    assert ckpt.is_gradient_checkpointing and not teacher.is_gradient_checkpointing
    calls = []
    for layer in decoder_layers(ckpt):  # count the layers that go through the checkpoint
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = \
            lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    ids = torch.randint(0, 97, (3, 11))
    h0, g0 = hidden_and_grads(plain, ids)
    h1, g1 = hidden_and_grads(ckpt, ids)
    assert len(calls) == 2  # both decoder layers
    torch.testing.assert_close(h1, h0, rtol=1e-12, atol=1e-12)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-12, msg=name)


def test_compile_wraps_every_decoder_layer_and_computes_the_same():
    plain, compiled = tiny_llama(layers=2), tiny_llama(layers=2)
    apply_levers(Speed(compile=True, compile_backend="eager"), compiled)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled))
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(0, 97, (2, 9))
    h0, g0 = hidden_and_grads(plain, ids)
    h1, g1 = hidden_and_grads(compiled, ids)
    torch.testing.assert_close(h1, h0, rtol=1e-12, atol=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-12, msg=name)



def test_compile_with_gradient_checkpointing_computes_the_same():
    """The two levers together (compiled layers that recompute in backward): the same hidden
    states and every gradient as neither. aot_eager traces the backward as inductor does,
    without a compiler on the CI machine."""
    plain, both = tiny_llama(layers=2), tiny_llama(layers=2)
    applied = apply_levers(Speed(compile=True, compile_backend="aot_eager",
                                 gradient_checkpointing=True), both)
    assert applied == ["gradient_checkpointing", "compile"]
    assert all(layer._compiled_call_impl is not None and layer.gradient_checkpointing
               for layer in decoder_layers(both))
    ids = torch.randint(0, 97, (2, 9))
    h0, g0 = hidden_and_grads(plain, ids)
    h1, g1 = hidden_and_grads(both, ids)
    torch.testing.assert_close(h1, h0, rtol=1e-12, atol=1e-12)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-12, msg=name)

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_liger_refuses_without_a_gpu_or_the_package():
    with pytest.raises((ImportError, RuntimeError), match="speed.liger=true needs"):
        apply_levers(Speed(liger=True), tiny_llama())


def test_flash_attention_is_refused_clearly_when_missing():
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ImportError, match="needs the flash-attn package.*sdpa is the default"):
        apply_levers(Speed(attention="flash_attention_2"), tiny_llama())


def test_attention_lever_switches_both_models():
    student, teacher = tiny_llama(), tiny_llama(seed=1)
    apply_levers(Speed(attention="eager"), student, teacher)
    assert student.config._attn_implementation == teacher.config._attn_implementation == "eager"


def test_train_applies_the_levers_from_the_config(compose_cfg, monkeypatch):
    import distill.run.train

    seen = {}
    monkeypatch.setattr(distill.run.train, "apply_levers",
                        lambda speed, student, teacher, packing: seen.update(
                            speed=speed, teacher=teacher, packing=packing))
    cfg = compose_cfg("speed.gradient_checkpointing=true", "trainer.max_steps=1",
                      "trainer.val_check_interval=1")
    distill.run.train.train(cfg)
    assert seen["speed"] == Speed(gradient_checkpointing=True)
    assert isinstance(seen["teacher"], torch.nn.Module)
    assert seen["packing"] is False  # the config's data.packing


def _bench_train():
    sys.path.insert(0, str(ROOT / "bench"))  # the benchmarks import each other by name
    import bench_train

    return bench_train


def test_bench_timing_is_the_median_step_after_warmup():
    """timed_ms on CPU: warm-up calls are not timed, the result is the median of `reps`
    timed calls (steps of 30, 10 and 50 ms here: 30 ms, whatever the order)."""
    import time
    from types import SimpleNamespace

    bench_train = _bench_train()
    delays = iter([0.2, 0.2, 0.03, 0.01, 0.05])  # two warm-ups of 200 ms, then three steps
    calls = []

    def step():
        calls.append(None)
        time.sleep(next(delays))

    ms = bench_train.timed_ms(step, SimpleNamespace(cuda=False), warm=2, reps=3)
    assert len(calls) == 5 and 29 <= ms < 45, ms


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_bench_train_tiny_runs_every_row_on_cpu(tmp_path):
    bench_train = _bench_train()
    rows = bench_train.main(["--tiny", "--pairs", "qwen", "--levers-on", "qwen", "--levers",
                             "flash", "--max-rows", "2", "--reps", "1", "--out", str(tmp_path)])
    by = {r["name"]: r for r in rows}
    for name in ("teacher forward alone (floor)", "full logits + torch KL", "distill",
                 "distill, checkpointing", "cached top-64, targets on the GPU",
                 "cached top-64, targets from a prefetching DataLoader (2 workers)"):
        r = by[f"qwen: {name}"]
        assert r["ms"] > 0, name  # timed_ms itself: the test above
        # the throughput is the row's tokens over its step time (ms is rounded to 0.1)
        tokens, ms = r["rows"] * r["seq"], r["ms"]
        assert r["rows"] == 2 and r["seq"] > 1, r
        assert abs(r["tokens_per_s"] - tokens / ms * 1e3) <= 1 + tokens / ms**2 * 50, r
    assert by["qwen: distill: largest micro-batch"]["largest_rows"] == 2
    assert by["lever flash-attention varlen"]["skipped"].startswith("unavailable")
    assert (tmp_path / "bench_train.json").exists()


def test_fused_optimizer_with_clipping_is_refused_where_lightning_would_stop(compose_cfg):
    from lightning.pytorch.plugins.precision import MixedPrecision

    from distill.run.config import ConfigError, validate

    # Lightning's AMP plugin refuses to clip for a fused optimizer, GradScaler or not;
    # distill clips by norm without it (tests/test_clipping.py) where no GradScaler scales
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        MixedPrecision("bf16-mixed", "cpu").clip_gradients(fused, 1.0)
    args = ("+experiment=hf_sft", "paths.data=.", "+optimizer.fused=true")
    for precision in ("16-mixed", "16"):  # the GradScaler's (Lightning's two names)
        with pytest.raises(ConfigError, match=rf"optimizer.fused=true with trainer.gradient_"
                           rf"clip_val=1.0 under trainer.precision={precision}: its "
                           r"GradScaler .*set optimizer.fused=false"):
            validate(compose_cfg(*args, f"trainer.precision={precision}"))
    for precision in ("bf16-mixed", "bf16"):
        validate(compose_cfg(*args, f"trainer.precision={precision}"))  # by norm: fine
        with pytest.raises(ConfigError, match=r"Lightning clips by value through its AMP "
                           r"plugin.* or trainer.gradient_clip_algorithm=norm"):
            validate(compose_cfg(*args, f"trainer.precision={precision}",
                                 "+trainer.gradient_clip_algorithm=value"))
    # FSDP's plugin would clip the scaled gradients instead of stopping: refused as well
    with pytest.raises(ConfigError, match=r"under FSDP they would be clipped while scaled"):
        validate(compose_cfg(*args, "trainer=fsdp", "trainer.accelerator=auto",
                             "trainer.precision=16-mixed"))
    validate(compose_cfg(*args, "trainer=fsdp", "trainer.accelerator=auto",
                         "trainer.precision=bf16-mixed",
                         "+trainer.gradient_clip_algorithm=value"))  # FSDP's plugin clips
    validate(compose_cfg(*args, "trainer=cpu", "trainer.precision=16-mixed"))  # bf16 on CPU
    validate(compose_cfg(*args, "trainer.precision=16-mixed", "trainer.gradient_clip_val=null"))
    validate(compose_cfg(*args, "trainer.precision=32-true",  # no AMP plugin: fine
                         "+trainer.gradient_clip_algorithm=value"))


@pytest.mark.slow  # ~20 s on a 2-core CPU (make test runs it)
def test_bench_levers_tiny_times_each_combination_in_its_own_process(tmp_path):
    from tests.fixtures import load_script

    bench = load_script("bench/bench_levers.py")
    got = bench.main(["--tiny", "--out", str(tmp_path), "--combos",
                      "none,compile + checkpointing,liger", "--timeout", "300"])
    for name in ("none", "compile + checkpointing"):
        r = got[name]
        assert r["step"]["ms"] > 0 and r["teacher forward"]["ms"] > 0, r
    # each combination ran in its own process with its own levers
    assert got["compile + checkpointing"]["applied"] == ["gradient_checkpointing", "compile"]
    assert got["none"]["applied"] == []
    if not torch.cuda.is_available():
        assert got["liger"] == {"skipped": "Liger's kernels need a CUDA GPU"}
    assert json.loads((tmp_path / "levers.json").read_text()).keys() == got.keys()


TRACES = []  # (phase, per tensor input the symbolic dims) of each graph dynamo traced
CALLS = []  # (phase, the called graph's symbolic dims) of each call of a traced graph
PHASE = ["checks"]


def _recording_backend(gm, example_inputs):
    dims = []
    for node in gm.graph.nodes:
        v = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(v, torch.Tensor):
            dims.append(tuple(i for i, d in enumerate(v.shape) if isinstance(d, torch.SymInt)))
    TRACES.append((PHASE[0], tuple(dims)))

    def call(*args):
        CALLS.append((PHASE[0], tuple(dims)))
        return gm.forward(*args)
    return call


def _traces(compose_cfg, out, monkeypatch, *overrides, experiment="sft_fkl"):
    """The graphs traced before the first training forward ("checks": the head check, a
    rollout) and in the training forwards, of a 2-step run with compiled layers."""
    from torch._dynamo import list_backends, register_backend

    from distill.train import train
    from distill.training.objective import Objective

    if "distill_test_recorder" not in list_backends(exclude_tags=()):
        register_backend(_recording_backend, name="distill_test_recorder")
    forward, forwards = Objective.train, [0]

    def marked(self, *a, **kw):
        forwards[0] += 1
        PHASE[0] = f"training {forwards[0]}"
        try:
            return forward(self, *a, **kw)
        finally:
            PHASE[0] = "between"

    monkeypatch.setattr(Objective, "train", marked)
    torch.compiler.reset()
    TRACES.clear()
    CALLS.clear()
    PHASE[0] = "checks"
    train(compose_cfg(f"+experiment={experiment}", "speed.compile=true", "trainer.max_steps=2",
                      "speed.compile_backend=distill_test_recorder",
                      "trainer.num_sanity_val_steps=0", "callbacks.export=null", *overrides,
                      out=out))
    return ([t for phase, t in TRACES if phase == "checks"],
            [t for phase, t in TRACES if phase.startswith("training")],
            [t for phase, t in TRACES if phase == "training 1"])


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6")
def test_the_head_check_traces_nothing_and_the_first_batch_compiles_as_without_it(
        compose_cfg, tmp_path, monkeypatch):
    """HeadCheck runs both models on one row of 16 tokens before the first step. Compiled
    code traced there would be thrown away before the first training forward (traced at 16
    tokens, it would make the batch's graphs dynamic: slower kernels all run long,
    flex_attention's 1.5-1.8x on the H200), its compile time spent for nothing. The check
    runs compiled code eagerly: nothing is traced
    there, it still compares both models' logits, and training traces the same graphs as a
    run without the check."""
    from distill.training.callbacks import head_check

    compared, compare = [], head_check.head_mismatch

    def spied(model, *a, **kw):
        compared.append(type(model).__name__)
        return compare(model, *a, **kw)

    monkeypatch.setattr(head_check, "head_mismatch", spied)
    checks, training, _ = _traces(compose_cfg, tmp_path / "a", monkeypatch)
    assert len(compared) == 2 and not checks  # student and teacher checked, nothing traced
    no_checks, alone, _ = _traces(compose_cfg, tmp_path / "b", monkeypatch,
                                  "callbacks.head_check=null")
    assert len(compared) == 2 and not no_checks and alone
    assert training == alone
    assert not any(0 in dims for graph in training for dims in graph)  # the batch stays static


def test_the_first_training_forward_after_a_rollout_keeps_batch_and_length_static(
        compose_cfg, tmp_path, monkeypatch):
    """On-policy: the first rollout's generate traces the compiled layers at its prompt and
    decode shapes before the first training forward; that forward is still traced at its
    own shape: batch and length static (the hidden size, which the student and the teacher
    do not share, is dynamic in the second model's trace whatever ran before)."""
    checks, _, first = _traces(compose_cfg, tmp_path / "op", monkeypatch,
                               "loss.on_policy.max_new_tokens=4", experiment="onpolicy_rkl")
    assert checks and first
    assert not any({0, 1} & set(dims) for graph in first for dims in graph), first


def test_training_after_a_validation_still_runs_the_static_graphs(compose_cfg, tmp_path,
                                                                  monkeypatch):
    """The validation runs the teacher under the same guards as its training forward, on
    batches of other sizes (the last one smaller): the graphs it traces would catch every
    later training call. After each validation the next training forward traces afresh, so
    every training call, before and after, runs a graph static in batch and length."""
    _traces(compose_cfg, tmp_path / "v", monkeypatch, "trainer.max_steps=5",
            "trainer.val_check_interval=2", "+data.pad_to_multiple_of=128",
            "data.batch_size=5")
    validated = [phase for phase, _ in CALLS if phase == "between"]
    training = [(phase, dims) for phase, dims in CALLS if phase.startswith("training")]
    assert validated and {p for p, _ in training} == {f"training {i}" for i in range(1, 6)}
    assert not [c for c in training if any({0, 1} & set(d) for d in c[1])], training


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_later_rollouts_leave_every_training_forward_on_the_static_graphs(
        compose_cfg, tmp_path, monkeypatch):
    """From the second step on, each rollout's generate (the student's, and the teacher's for
    its share of the rows) runs the compiled layers at its prompt and decode shapes after
    the training graphs exist, without a fresh trace after it. Those calls trace graphs of
    their own, and every step's training forwards still run graphs static in batch and
    length (the width is fixed here, so nothing else makes them dynamic)."""
    from distill.onpolicy.samplers import HFSampler

    sample, writers = HFSampler.__call__, []

    def recorded(self, model, prompts, *, seed):
        writers.append((PHASE[0], model.config.hidden_size))
        return sample(self, model, prompts, seed=seed)

    monkeypatch.setattr(HFSampler, "__call__", recorded)
    _traces(compose_cfg, tmp_path / "op", monkeypatch, "trainer.max_steps=3",
            "loss.on_policy.max_new_tokens=4", "loss.on_policy.teacher_fraction=0.5",
            "+data.pad_to_multiple_of=128", experiment="onpolicy_rkl")
    later = {size for phase, size in writers if phase == "between"}
    assert len(later) == 2, writers  # the student and the teacher sampled after step 1
    rolled = [dims for phase, dims in TRACES if phase == "between"]
    training = [(phase, dims) for phase, dims in CALLS if phase.startswith("training")]
    assert rolled and {p for p, _ in training} == {f"training {i}" for i in range(1, 4)}
    assert not [c for c in training if any({0, 1} & set(d) for d in c[1])], training


def _watched(compose_cfg, out, capsys, *overrides, experiment="sft_fkl"):
    """A compiled run's summary, its CompileWatch warnings, its printed summary and the
    number of graphs the backend received (each graph dynamo builds goes through it once)."""
    import warnings

    from torch._dynamo import list_backends, register_backend

    from distill.train import train

    if "distill_test_recorder" not in list_backends(exclude_tags=()):
        register_backend(_recording_backend, name="distill_test_recorder")
    torch.compiler.reset()
    TRACES.clear()
    PHASE[0] = "run"
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train(compose_cfg(f"+experiment={experiment}", "speed.compile=true",
                                "speed.compile_backend=distill_test_recorder",
                                "trainer.num_sanity_val_steps=0", "callbacks.export=null",
                                *overrides, out=out))
    late = [str(w.message) for w in caught if "torch.compile built" in str(w.message)]
    return out, late, capsys.readouterr().out, len(TRACES)


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6")
def test_the_run_counts_the_graphs_it_compiles_and_warns_for_late_ones(compose_cfg, tmp_path,
                                                                      capsys):
    """CompileWatch: every graph the backend received is counted once, by training steps,
    validation or rollouts; graphs of the first step and of the first step after a
    validation are the warm-up (DistillModule traces afresh there); one a training step
    builds in any other step is a warning naming the step. Batch widths fixed at 128 (the
    last step followed by a validation): none late. Widths left to each batch's longest row:
    the second width makes a dynamic graph, late, in step 2."""
    fixed, warned, printed, received = _watched(
        compose_cfg, tmp_path / "fixed", capsys, "trainer.max_steps=4",
        "trainer.val_check_interval=2", "+data.pad_to_multiple_of=128", "data.batch_size=5")
    c = fixed["compile"]
    assert c["late"] == 0 and c["validation"] and not c["rollouts"] and not warned, c
    assert c["graphs"] + c["validation"] == received
    assert (f"torch.compile:    {c['graphs']} graphs built by training steps ("
            f"{c['validation']} in validation), none after the warm-up") in printed

    free, warned, printed, received = _watched(compose_cfg, tmp_path / "free", capsys,
                                               "trainer.max_steps=4",
                                               "trainer.val_check_interval=10")
    c = free["compile"]
    assert c["graphs"] == received and c["late"] > 0 and not c["validation"], c
    assert c["late_steps"][0] == 2, c
    assert warned and "in optimizer step 2, after the warm-up" in warned[0], warned
    assert len(warned) == len(c["late_steps"])
    assert (f"torch.compile:    {received} graphs built by training steps, {c['late']} after "
            f"the warm-up (steps {', '.join(map(str, c['late_steps']))})") in printed


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch < 2.6")
def test_rollout_graphs_are_counted_apart_and_never_warned_about(compose_cfg, tmp_path, capsys):
    """On-policy: each step's generate runs the compiled layers at its prompt and decode
    shapes, and the warm-up steps drop those graphs with the rest, so later rollouts build
    them again. That is the design, not a shape the user can fix: counted apart, no
    warning; the training steps themselves (fixed widths) build none after the warm-up."""
    out, warned, printed, received = _watched(
        compose_cfg, tmp_path / "op", capsys, "trainer.max_steps=5",
        "trainer.val_check_interval=2", "loss.on_policy.max_new_tokens=4",
        "+data.pad_to_multiple_of=128", experiment="onpolicy_rkl")
    c = out["compile"]
    assert c["rollouts"] and c["late"] == 0 and not warned, (c, warned)
    assert c["graphs"] + c["rollouts"] + c["validation"] == received, c


def test_a_run_without_compiled_code_prints_no_compile_line(compose_cfg, tmp_path, capsys):
    from distill.train import train

    capsys.readouterr()
    out = train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2",
                            "callbacks.export=null", out=tmp_path / "eager"))
    assert out["compile"] is None and "torch.compile:" not in capsys.readouterr().out
