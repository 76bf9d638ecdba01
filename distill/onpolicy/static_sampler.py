"""A fast `Sampler`: bf16 generation weights, a static KV cache, CUDA-graph decoding.

`HFSampler` runs `generate` on the fp32 master weights with a dynamic cache; a decode step
there is bound by kernel launches and Python, not by the GPU. `StaticSampler` decodes the
whole window's prompts as one batch, padded to a few bucketed shapes (batch, prompt length):

- weights: a bf16 copy of a trainable student, refreshed in place before each rollout (LoRA
  adapters merged in); a frozen model already in that dtype (the teacher) is used as it is;
- layers: in the copy of a Llama-family model, fused decode modules (fused_layers.py): a
  small model's step is hundreds of tiny kernels, and these cut them about five-fold;
- prefill: one eager forward of the left-padded prompts into a `StaticCache` (views of one
  pool shared by all buckets), with its own 4D mask and position ids;
- decode: one step = forward of the last token + choosing the next, written into
  preallocated buffers updated in place (mask, position ids, write position, step, done
  flags), so it has no host sync and no data-dependent branch. On CUDA the step of each
  bucket is captured once as a CUDA graph after two eager warm-up steps, then replayed;
  elsewhere it runs eagerly, the same code;
- stop: the host reads the rows' done flags every `check_every` steps, not every token.

Draws are a hash of (seed, row, step) (see draws.py): completions do not depend on the
bucket, the padding rows or the chunking, and equal seeds give equal completions. `captures`
counts graph captures; `recaptures` those of a bucket captured before (after the KV pool
grew or a model's weights moved), which a run should see only in its first steps.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from distill.onpolicy.draws import choose, uniforms
from distill.onpolicy.gen_weights import GenerationCopy, needs_copy
from distill.onpolicy.static_kv import (
    ATTENTION,
    KVPool,
    attention_as,
    cache_argument,
    check_supported,
    register_attention,
    reset,
)

log = logging.getLogger(__name__)
WARMUP_STEPS = 2  # eager decode steps of a bucket before its capture


@dataclass
class StaticSampler:
    """`sampler(model, prompts, seed=...)`: one completion per prompt, ending with an eos token
    when the model stopped. Same constructor head as `HFSampler`; the rest has defaults."""

    temperature: float
    top_p: float
    max_new_tokens: int
    eos_token_ids: list[int]
    pad_token_id: int
    vocab_size: int | None = None  # ids past the tokenizer (padded head rows) never sampled
    dtype: torch.dtype | None = None  # generation weights; None: bf16 on CUDA, else the model's
    cuda_graphs: bool | None = None  # None: on CUDA devices
    batch_buckets: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256)  # more rows: in chunks
    prompt_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    check_every: int = 16  # decode steps between two host reads of the done flags
    fused: bool | None = None  # fused decode modules in the copy; None: where supported
    captures: int = field(default=0, init=False)
    recaptures: int = field(default=0, init=False)
    last: dict = field(default_factory=dict, init=False)  # what the latest call did

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(f"StaticSampler: temperature={self.temperature} must be >= 0, "
                             f"top_p={self.top_p} in (0, 1], max_new_tokens="
                             f"{self.max_new_tokens} >= 1")
        if not self.eos_token_ids:
            raise ValueError("StaticSampler needs at least one eos token id")
        self.batch_buckets = tuple(sorted(self.batch_buckets))
        self.prompt_buckets = tuple(sorted(self.prompt_buckets))
        self._engines: dict[int, _Engine] = {}
        register_attention()

    # --- the Sampler interface ----------------------------------------------------------
    def __call__(self, model, prompts: list[list[int]], *, seed: int) -> list[list[int]]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("StaticSampler: every prompt needs at least one token")
        start = time.perf_counter()
        out = self.engine(model).generate(prompts, seed, self.max_new_tokens)
        self.last["seconds"] = time.perf_counter() - start
        return out

    def warmup(self, model, batch_sizes, prompt_len: int) -> None:
        """Capture the buckets of these batch sizes at this prompt length now (largest first,
        so the KV pool is allocated once), with a few throwaway decode steps each."""
        engine = self.engine(model)
        for batch in sorted({self.batch_bucket(b) for b in batch_sizes}, reverse=True):
            engine.generate([[self.pad_token_id] * prompt_len] * batch, 0,
                            min(self.max_new_tokens, WARMUP_STEPS + 2))

    def engine(self, model) -> _Engine:
        """The model's decoding state (generation copy, KV pool, graphs), built on first use."""
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the model in it
        engine = self._engines.get(id(model))
        if engine is None or engine.source() is not model:
            engine = self._engines[id(model)] = _Engine(self, model)
        return engine

    def stats(self) -> dict:
        """Counters for the run's log: captures, recaptures, bytes held, the latest call."""
        return {"captures": self.captures, "recaptures": self.recaptures,
                "fused": [bool(e.copy and e.copy.fused) for e in self._engines.values()],
                "copy_bytes": sum(e.copy_bytes for e in self._engines.values()),
                "kv_bytes": sum(e.pool.nbytes for e in self._engines.values()), **self.last}

    # --- buckets ------------------------------------------------------------------------
    def batch_bucket(self, rows: int) -> int:
        return next((b for b in self.batch_buckets if b >= rows), self.batch_buckets[-1])

    def prompt_bucket(self, length: int) -> int:
        top = self.prompt_buckets[-1]
        return next((b for b in self.prompt_buckets if b >= length), -(-length // top) * top)


class _Engine:
    """One model's decoding state: its generation weights, KV pool, buckets and graphs."""

    def __init__(self, sampler: StaticSampler, model):
        self.sampler, self.source = sampler, weakref.ref(model)
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if sampler.cuda_graphs is None \
            else sampler.cuda_graphs and self.device.type == "cuda"
        dtype = sampler.dtype or (torch.bfloat16 if self.device.type == "cuda"
                                  else next(model.parameters()).dtype)
        check_supported(model.config)
        self.copy = None
        if needs_copy(model, dtype):
            self.copy = GenerationCopy(model, dtype, fused=sampler.fused)
        if self.copy is not None:
            self.copy.model.config._attn_implementation = ATTENTION
        self.model = self.copy.model if self.copy is not None else model
        self.copy_bytes = self.copy.nbytes if self.copy is not None else 0
        self.cache_kw = cache_argument(self.model)
        rows = self.model.get_output_embeddings().weight.shape[0]
        self.vocab = min(sampler.vocab_size or rows, rows)
        self.pool = KVPool(self.model.config, dtype, self.device)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.captured: set[tuple[int, int]] = set()
        self.eos = torch.tensor(sampler.eos_token_ids, device=self.device)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.side = torch.cuda.Stream(self.device) if self.graphs else None
        self.addresses = self._addresses()

    def _addresses(self) -> tuple:
        return tuple(p.data_ptr() for p in self.model.parameters())

    # --- one call -----------------------------------------------------------------------
    def generate(self, prompts, seed: int, steps: int) -> list[list[int]]:
        s = self.sampler
        if self.copy is not None:
            self.copy.refresh()
        elif self._addresses() != self.addresses:  # weights moved: graphs point at old ones
            self.buckets.clear()
            self.addresses = self._addresses()
        model, top = self.model, s.batch_buckets[-1]
        was_training = model.training
        model.eval()
        out, done_steps, keys = [], [], []
        try:
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False), \
                    attention_as(model.config, ATTENTION):
                for row0 in range(0, len(prompts), top):  # rows past the largest bucket
                    chunk = prompts[row0: row0 + top]
                    b = self._bucket(s.batch_bucket(len(chunk)),
                                     s.prompt_bucket(max(map(len, chunk))))
                    done_steps.append(self._rollout(b, chunk, row0, seed, steps))
                    keys.append((b.batch, b.prompt))
                    out += _until_eos(b.tokens[: len(chunk), : done_steps[-1]].tolist(),
                                      s.eos_token_ids)
        finally:
            model.train(was_training)
        s.last = {"rows": len(prompts), "buckets": keys, "steps": done_steps}
        return out

    def _bucket(self, batch: int, prompt: int) -> _Bucket:
        # a multiple of 16: SDPA's memory-efficient kernel would pad the mask every layer
        length = -(-(prompt + self.sampler.max_new_tokens) // 16) * 16
        if not self.pool.fits(batch, length):
            if self.pool.batch:
                log.info("static sampler: KV pool grows to batch %d, length %d; graphs of "
                         "the smaller pool are recaptured", batch, length)
            self.buckets.clear()  # their caches and graphs point at the old pool
            self.pool.grow(batch, length)
        key = (batch, prompt)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(self, batch, prompt, length)
        return self.buckets[key]

    def _rollout(self, b: _Bucket, prompts, row0: int, seed: int, steps: int) -> int:
        """Prefill, then decode until every real row is done or `steps` tokens are out."""
        self._prefill(b, prompts, row0, seed)
        n, every = len(prompts), self.sampler.check_every
        for t in range(1, steps):
            self._step(b)
            if (t + 1) % every == 0 and bool(b.done[:n].all()):
                return t + 1
        return steps

    # --- prefill and decode -------------------------------------------------------------
    def _logits(self, ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: cache})
        return out.logits[:, -1, : self.vocab]  # (B, V): padded head rows cut off

    def _prefill(self, b: _Bucket, prompts, row0: int, seed: int) -> None:
        P, L = b.prompt, b.length
        ids = torch.full((b.batch, P), self.sampler.pad_token_id, dtype=torch.long)
        valid = torch.zeros((b.batch, L), dtype=torch.bool)
        valid[len(prompts):, P - 1] = True  # filler rows attend to one pad token
        for i, p in enumerate(prompts):  # left-padded: every row's last token at P - 1
            ids[i, P - len(p):] = torch.tensor(p)
            valid[i, P - len(p): P] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        positions = (valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)  # as generate does
        q, k = torch.arange(P, device=self.device)[:, None], b.arange[None, :]
        # causal, real keys only; a pad query sees itself, so no softmax row is empty
        mask = (k <= q) & (valid[:, None, :] | (k == q))  # (B, P, L)
        reset(b.cache)
        b.prompt_mask.copy_(valid[:, None, None, :])
        b.seed.fill_(seed)
        b.rows.copy_(torch.arange(row0, row0 + b.batch, device=self.device))
        b.done.zero_()
        b.step.zero_()
        b.tokens.fill_(self.sampler.pad_token_id)
        if self.sampler.temperature > 0:  # every step's draws at once: one gather a step
            b.draws.copy_(uniforms(b.seed, b.rows[:, None], b.steps[None, :]))
        logits = self._logits(ids, mask[:, None], positions, b.cache)
        b.positions.copy_(valid[:, :P].sum(-1, keepdim=True))
        b.write.fill_(P)
        self._pick(b, logits)

    def _advance(self, b: _Bucket) -> torch.Tensor:
        """The forward of one decode step: logits of the token at the write position."""
        seen = b.prompt_mask | ((b.arange >= b.prompt) & (b.arange <= b.write))  # (B,1,1,L)
        # additive, once per step: SDPA would convert a boolean mask in every layer
        mask = torch.where(seen, b.zero, b.minus_inf)
        logits = self._logits(b.input_ids, mask, b.positions, b.cache)
        b.positions.add_(1)
        b.write.add_(1)
        return logits

    def _pick(self, b: _Bucket, logits: torch.Tensor) -> None:
        s = self.sampler
        u = b.draws.index_select(1, b.step.view(1))[:, 0] if s.temperature > 0 else None
        token = choose(logits, u, s.temperature, s.top_p)
        token = torch.where(b.done, s.pad_token_id, token)  # a finished row writes pads
        b.tokens.index_copy_(1, b.step.view(1), token[:, None])
        b.done.logical_or_((token[:, None] == self.eos).any(-1))
        b.input_ids.copy_(token[:, None])
        b.step.add_(1)

    def _step(self, b: _Bucket) -> None:
        if not self.graphs:
            self._pick(b, self._advance(b))
            return
        if b.graph is None:
            if b.warm < WARMUP_STEPS:  # eager, on a side stream, as capture wants
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    self._pick(b, self._advance(b))
                torch.cuda.current_stream(self.device).wait_stream(self.side)
                b.warm += 1
                return
            self._capture(b)
        if b.graph is False:  # capture failed: this bucket decodes eagerly
            self._pick(b, self._advance(b))
            return
        b.graph.replay()
        if not b.graph_picks:
            self._pick(b, b.logits)

    def _capture(self, b: _Bucket) -> None:
        """Graph the whole step; failing that, the forward alone (choice made eagerly);
        failing that too, no graph (warned: a step then costs what it costs eagerly)."""
        s, key = self.sampler, (b.batch, b.prompt)
        start = time.perf_counter()
        for picks in (True, False):
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                out = self._record(graph, (lambda: self._pick(b, self._advance(b))) if picks
                                   else (lambda: self._advance(b)))
            except Exception as err:  # noqa: BLE001 - any capture failure falls back
                log.warning("static sampler: capturing the decode step of bucket %s %s "
                            "failed (%s: %s)", key, "with the token choice" if picks else
                            "(forward only)", type(err).__name__, err)
                torch.cuda.synchronize(self.device)
                continue
            b.graph, b.graph_picks, b.logits = graph, picks, out
            break
        else:
            b.graph = False
        s.captures += b.graph is not False
        s.recaptures += key in self.captured and b.graph is not False
        self.captured.add(key)
        b.capture_s = time.perf_counter() - start

    def _record(self, graph, body):
        """Capture body() into graph on the warm-up stream, all graphs sharing one pool (a
        bucket's graph runs alone, and its state lives in the bucket's own buffers)."""
        with torch.cuda.graph(graph, pool=self.graph_pool, stream=self.side):
            return body()


class _Bucket:
    """The static buffers of one (batch, prompt length) shape; a graph reads them in place."""

    def __init__(self, engine: _Engine, batch: int, prompt: int, length: int):
        dev, n = engine.device, engine.sampler.max_new_tokens
        self.batch, self.prompt, self.length = batch, prompt, length
        self.cache = engine.pool.views(batch, length)
        self.arange = torch.arange(length, device=dev)  # (L,)
        self.prompt_mask = torch.zeros((batch, 1, 1, length), dtype=torch.bool, device=dev)
        self.zero = torch.zeros((), dtype=engine.pool.dtype, device=dev)
        self.minus_inf = torch.full((), float("-inf"), dtype=engine.pool.dtype, device=dev)
        self.input_ids = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.write = self.cache.write  # () the cache index the next decode token goes to
        self.step = torch.zeros((), dtype=torch.long, device=dev)  # index of the next token
        self.seed = torch.zeros((), dtype=torch.long, device=dev)
        self.rows = torch.zeros((batch,), dtype=torch.long, device=dev)
        self.done = torch.zeros((batch,), dtype=torch.bool, device=dev)
        self.tokens = torch.zeros((batch, n), dtype=torch.long, device=dev)
        self.draws = torch.zeros((batch, n), dtype=torch.float32, device=dev)  # (row, step)
        self.steps = torch.arange(n, device=dev)
        self.graph = None  # a CUDAGraph once captured, False when capture failed
        self.graph_picks = True  # the graph includes the token choice
        self.logits: torch.Tensor | None = None  # graph output when it does not
        self.warm = 0
        self.capture_s = 0.0


def _until_eos(rows: list[list[int]], eos: list[int]) -> list[list[int]]:
    stop = set(eos)
    out = []
    for tokens in rows:
        end = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
        out.append(tokens[:end])
    return out
