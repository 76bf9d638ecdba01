"""The CUDA-graph bookkeeping of the static sampler, on CPU with a stand-in graph that replays
by calling the captured step again: warm-up steps, one capture per bucket, no capture after
the warm-up, recaptures counted when the KV pool grows, and the eager fallback when a capture
fails. Tokens must equal those of plain eager decoding. (The real graphs run on the GPU in
bench/check_static_sampler_gpu.py.)"""

import contextlib

import pytest
import torch

from distill.onpolicy import static_sampler
from tests.onpolicy.helpers import EOS, PAD, PROMPTS, VOCAB, tiny


class FakeGraph:
    def __init__(self):
        self.body, self.replays = None, 0

    def replay(self):
        self.replays += 1
        self.body()


@pytest.fixture
def fake_cuda(monkeypatch):
    """Graphs on CPU: capture records the step (running nothing, like a real capture)."""
    state = {"fail": False, "records": 0}

    def record(self, graph, body):
        state["records"] += 1
        if state["fail"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph.body = body

    monkeypatch.setattr(static_sampler._Engine, "_record", record)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return state


class _Stream:
    def wait_stream(self, other):
        pass


def graphed(s, model):
    engine = s.engine(model)
    engine.graphs, engine.side = True, _Stream()
    return engine


def make(temperature=1.0, top_p=1.0, new=12, **kw):
    return static_sampler.StaticSampler(temperature, top_p, new, [EOS], PAD, VOCAB, **kw)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 0.9)])
def test_replays_give_the_eager_tokens(fake_cuda, temperature, top_p):
    model = tiny("qwen2")
    want = make(temperature, top_p)(model, PROMPTS, seed=3)
    s = make(temperature, top_p)
    engine = graphed(s, model)
    assert s(model, PROMPTS, seed=3) == want
    bucket = engine.buckets[(8, 64)]
    assert s.captures == 1 and bucket.graph_picks and bucket.warm == 2
    assert bucket.graph.replays == 12 - 1 - 2  # tokens - prefill's - warm-up steps
    assert s(model, PROMPTS, seed=3) == want  # replayed from the first step on
    assert s.captures == 1 and bucket.graph.replays == 9 + 11


def test_no_capture_after_warmup_and_recaptures_when_the_pool_grows(fake_cuda):
    model = tiny()
    s = make()
    graphed(s, model)
    s.warmup(model, [3, 20], prompt_len=40)  # buckets (32, 64) then (4, 64)
    assert s.captures == 2 and s.recaptures == 0
    for rows in (PROMPTS[:3], PROMPTS * 4, PROMPTS[:2]):  # 3, 20, 2 rows: buckets 4, 32, 4
        s(model, rows, seed=0)
    assert s.captures == 2
    s(model, PROMPTS * 8, seed=0)  # 40 rows: bucket 64, a larger pool
    assert s.captures == 3 and s.recaptures == 0
    s(model, PROMPTS[:3], seed=0)  # bucket 4 again: its old graph pointed at the old pool
    assert s.captures == 4 and s.recaptures == 1


def test_a_failed_capture_decodes_eagerly(fake_cuda):
    model = tiny()
    want = make()(model, PROMPTS, seed=1)
    fake_cuda["fail"] = True
    s = make()
    engine = graphed(s, model)
    assert s(model, PROMPTS, seed=1) == want
    assert engine.buckets[(8, 64)].graph is False
    assert s.captures == 0 and fake_cuda["records"] == 2  # whole step, then forward only
    assert s(model, PROMPTS, seed=1) == want and fake_cuda["records"] == 2  # never retried
