"""Random-weight student/teacher pairs at real shapes, and the training CLI run on them.

    python bench/make_real_shape_models.py --out /tmp/real --run          # GPU: 3 pairs
    python bench/make_real_shape_models.py --out /tmp/real --run --tiny   # CPU, tiny shapes

No model files are downloaded: each pair is built from its config (on the GPU in bf16 when
there is one), saved with `save_pretrained` (safetensors) beside a tokenizer of the
family's vocabulary size with a ChatML template (no `{% generation %}` markers: the
assistant spans come from the template itself), plus a small chat jsonl. With `--run`,
each pair then goes through `python -m distill.train +experiment=hf_sft` (SFT, packing
on) and the script prints, per pair, tokens/s, the loss per step and the GPU's peak
memory; its model folders are deleted afterwards unless `--keep` (the three pairs hold
~55 GB in bf16). Logs go to --logs, by default $OUT when set.

Pairs (shapes of the public configs; RoPE scaling left out, it does not change shapes):
  llama: Llama-3.2-1B student, Llama-3.1-8B teacher, V=128256
  qwen:  Qwen2.5-0.5B student (151936 head rows), Qwen2.5-7B teacher (152064 rows),
         tokenizer of 151665 tokens: the heads' padding rows are outside the loss
  gemma: Gemma-2-2B student, Gemma-2-9B teacher, V=256000, logits soft-capped at 30
  qwen3: Qwen3-0.6B student, Qwen3-8B teacher (q/k norms), V=151936 both, tokenizer of
         151669 tokens (built with --pairs qwen3; not in the default three)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_train_steps
sys.path.append(str(ROOT))  # distill from a checkout that is not installed
from bench_train_steps import LLAMA as STEP_LLAMA  # noqa: E402
from bench_train_steps import QWEN as STEP_QWEN  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

LLAMA = dict(rms_norm_eps=1e-5, max_position_embeddings=8192)
QWEN = dict(rms_norm_eps=1e-6, max_position_embeddings=32768)
QWEN3 = dict(rms_norm_eps=1e-6, max_position_embeddings=40960)
GEMMA = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
             final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
             max_position_embeddings=8192)
# pair -> (tokenizer size, (config class, student kwargs), (config class, teacher kwargs))
PAIRS = {  # llama and qwen: the training-step benchmark's shapes (bench_train_steps)
    "llama": (128256,
              (LlamaConfig, dict(vocab_size=128256, **STEP_LLAMA["student"], **LLAMA)),
              (LlamaConfig, dict(vocab_size=128256, **STEP_LLAMA["teacher"], **LLAMA))),
    "qwen": (151665,
             (Qwen2Config, dict(vocab_size=151936, **STEP_QWEN["student"], **QWEN)),
             (Qwen2Config, dict(vocab_size=152064, **STEP_QWEN["teacher"], **QWEN))),
    "qwen3": (151669,  # Qwen3's tokenizer; both heads have 151936 rows
              (Qwen3Config, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                 num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                 **QWEN3)),
              (Qwen3Config, dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                 num_hidden_layers=36, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                                 **QWEN3))),
    "gemma": (256000,
              (Gemma2Config, dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                                  num_hidden_layers=26, num_attention_heads=8,
                                  num_key_value_heads=4, tie_word_embeddings=True, **GEMMA)),
              (Gemma2Config, dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                  num_hidden_layers=42, num_attention_heads=16,
                                  num_key_value_heads=8, tie_word_embeddings=True, **GEMMA))),
}
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)


def shapes(pair: str, tiny: bool) -> tuple[int, dict, dict]:
    """(tokenizer size, student config, teacher config) of a pair; --tiny keeps each
    family's quirks and the head rows past the tokenizer, at a few hundred tokens."""
    vocab, (cls, student), (_, teacher) = PAIRS[pair]
    if not tiny:
        return vocab, cls(**student), cls(**teacher)
    small = 400
    out = []
    for kw, layers in ((student, 1), (teacher, 2)):
        kw = {**kw, **TINY, "num_hidden_layers": layers,
              "vocab_size": small + kw["vocab_size"] - vocab}
        if cls not in (Gemma2Config, Qwen3Config):  # these two set head_dim apart from width
            kw.pop("head_dim")
        out.append(cls(**kw))
    return small, *out


def make_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """`size` tokens: specials, every printable character, then lowercase strings of 2, 3
    (and 4 while they fit) letters, then unused fillers. Text splits into runs of at most
    the longest complete length, so any ASCII chat text round-trips exactly."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab.setdefault(ch, len(vocab))
    longest = 1
    for n in (2, 3, 4):
        if len(vocab) + 26**n > size:
            break
        for t in itertools.product(string.ascii_lowercase, repeat=n):
            vocab["".join(t)] = len(vocab)
        longest = n
    for i in range(size - len(vocab)):
        vocab[f"<unused_{i}>"] = len(vocab)
    if len(vocab) != size:
        raise ValueError(f"a vocabulary of {size} tokens is too small for the characters")
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"[a-z]{{1,{longest}}}|[^a-z]"),
                                              behavior="isolated")
    core.decoder = decoders.Fuse()  # tokens are pieces of the text: join them as they are
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                  pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def make_chat_data(folder: Path, n_train: int, n_val: int, tiny: bool, seed: int = 0):
    """Random-word conversations (a system turn sometimes, one or two exchanges)."""
    rng = random.Random(seed)
    most = 12 if tiny else 160

    def text(k):
        words = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                 for _ in range(rng.randint(3, k)))
        return " ".join(words).capitalize() + rng.choice([".", "?", "!"])

    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        rows = []
        for _ in range(n):
            msgs = [{"role": "system", "content": text(8)}] if rng.random() < 0.3 else []
            for _ in range(rng.choice([1, 1, 2])):
                msgs += [{"role": "user", "content": text(most // 2)},
                         {"role": "assistant", "content": text(most)}]
            rows.append({"messages": msgs})
        (folder / f"sft_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_pair(pair: str, root: Path, tiny: bool, device: str) -> dict:
    """Save the pair's student, teacher and tokenizer folders; return what was built."""
    t0 = time.perf_counter()
    size, student_cfg, teacher_cfg = shapes(pair, tiny)
    tok = make_tokenizer(size)
    info = {"pair": pair, "tokenizer_size": len(tok)}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for who, cfg in (("student", student_cfg), ("teacher", teacher_cfg)):
        torch.manual_seed(1 if who == "student" else 2)
        with torch.device(device):  # initialized where it is built: seconds even at 9B
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        path = root / pair / who
        model.save_pretrained(path)
        tok.save_pretrained(path)  # the teacher's folder is checked against the tokenizer
        info[f"{who}_class"] = type(model).__name__
        info[f"{who}_params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
        info[f"{who}_head_rows"] = model.get_output_embeddings().weight.shape[0]
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    info["build_s"] = round(time.perf_counter() - t0, 1)
    return info


class PeakMemory:
    """The GPU's peak used memory while a child process runs, polled from nvidia-smi
    (device-wide: it includes the CUDA context and the allocator's cache)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak_mib, self._stop = every_s, None, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                used = max(int(v) for v in out.split())
                self.peak_mib = max(self.peak_mib or 0, used)
            except (OSError, ValueError, subprocess.SubprocessError):
                return  # no nvidia-smi (CPU): peak stays None
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def train_command(pair_dir: Path, data: Path, out: Path, args) -> list[str]:
    """The CLI run: the real-model recipe, packing on, nothing saved but the logs."""
    gpu = torch.cuda.is_available()
    return [sys.executable, "-m", "distill.train", "+experiment=hf_sft",
            f"student.name_or_path={pair_dir / 'student'}",
            f"teacher.name_or_path={pair_dir / 'teacher'}",
            f"paths.data={data}",
            f"paths.output_dir={out}", "data.packing=true",
            f"data.max_length={args.max_length}", f"data.batch_size={args.batch_size}",
            f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
            "trainer.log_every_n_steps=1", "callbacks.checkpoint=null",
            "callbacks.export=null", "callbacks.throughput.window_size=2",
            *(["trainer=gpu"] if gpu else []), *args.overrides]


def run_pair(pair: str, root: Path, data: Path, logs: Path, args) -> dict:
    out = root / "runs" / pair
    cmd = train_command(root / pair, data, out, args)
    t0 = time.perf_counter()
    with PeakMemory() as mem, open(logs / f"train_{pair}.log", "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    result = {"rc": rc, "train_wall_s": round(time.perf_counter() - t0, 1),
              "peak_gpu_mib": mem.peak_mib}
    text = (logs / f"train_{pair}.log").read_text(errors="replace")
    result["head_check"] = "passed" if "head check passed for student, teacher" in text else \
        "see the log"
    metrics = sorted(out.glob("logs/version_*/metrics.csv"))
    if metrics:
        result.update(read_metrics(metrics[-1]))
    return result


def read_metrics(path: Path) -> dict:
    import csv

    rows = list(csv.DictReader(path.open()))
    col = lambda k: [float(r[k]) for r in rows if r.get(k)]  # noqa: E731
    # tokens/s of each step after the first, measured from the previous step's end: the
    # first step (kernel compilation, the head check) is left out
    rates = sorted(col("train/device/items_per_sec"))
    return {"train_loss": [round(v, 4) for v in col("train/loss")],
            "val_loss": col("val/loss")[-1:] or None,
            "tokens_per_s": round(rates[len(rates) // 2]) if rates else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/distill_real_shapes"))
    p.add_argument("--pairs", default="qwen,llama,gemma", help="in this order (smallest first)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU tests)")
    p.add_argument("--run", action="store_true", help="train each pair after building it")
    p.add_argument("--keep", action="store_true", help="keep the model folders")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=None, help="rows per step (4; tiny 2)")
    p.add_argument("--max-length", type=int, default=None, help="row length (2048; tiny 256)")
    p.add_argument("--examples", type=int, default=None, help="train conversations")
    p.add_argument("--logs", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT")
                   else None, help="logs and summary.json (default: $OUT, else <out>/logs)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the runs")
    args = p.parse_args(argv)
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.max_length = args.max_length or (256 if args.tiny else 2048)
    pairs = [x for x in args.pairs.split(",") if x]
    unknown = set(pairs) - set(PAIRS)
    if unknown:
        p.error(f"unknown pairs {sorted(unknown)}: choose from {', '.join(PAIRS)}")
    logs = args.logs or args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = args.out / "data"
    make_chat_data(data, args.examples or (24 if args.tiny else 240), 8, args.tiny)
    summary, failed = [], False
    for pair in pairs:
        info = build_pair(pair, args.out, args.tiny, device)
        if args.run:
            info.update(run_pair(pair, args.out, data, logs, args))
            failed |= info["rc"] != 0
            if not args.keep:
                shutil.rmtree(args.out / pair)
        summary.append(info)
        print(json.dumps(info), flush=True)
        (logs / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
