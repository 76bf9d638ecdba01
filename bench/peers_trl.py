"""One TRL trainer on the peers benchmark's job, in a process of its own (bench/bench_peers.py
starts it; TRL is a benchmark-only dependency: `pip install trl==1.16.0`).

    python bench/peers_trl.py --trainer distillation --student S --teacher T --data D.jsonl \
        --timer timer.json --out run/ --steps 8 --warmup 3 --batch 8 --accum 4 --new-tokens 128

`distillation`: `trl.DistillationTrainer`, on-policy only (every prompt answered by the
student with transformers' generate, one call for the step's batch x accumulation prompts,
then the chunked generalized JSD on each micro-batch). `gkd`: `trl.experimental.gkd
.GKDTrainer` with lmbda 0 (no sampling): the dataset's rows, the full logits of both models
and the generalized JSD on them. Both as their documentation sets them up, with the choices
the job fixes: fp32 master weights under bf16 autocast, a bf16 teacher, no gradient
checkpointing (TRL's default is on), beta 0.5, temperature 1, rows read in order.

The step clock is distill's StepTimer, driven from transformers' callback hooks: the same
synchronized clock and allocator peak the distill run reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.step_timer import StepTimer  # noqa: E402


class HFStepTimer(TrainerCallback):
    """StepTimer on a transformers Trainer: a step ends at `on_step_end` (after the optimizer
    step), its tokens are the trainer's `num_input_tokens_seen` since the last one."""

    def __init__(self, path: str, warmup: int):
        self.timer, self._seen = StepTimer(path, warmup), 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._seen = int(state.num_input_tokens_seen)
        self.timer.start(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        seen = int(state.num_input_tokens_seen)
        self.timer.step_done(seen - self._seen, 0)  # 0: transformers hides the batch's width
        self._seen = seen

    def on_train_end(self, args, state, control, **kwargs):
        self.timer.write()


def common_args(a, cuda: bool) -> dict:
    """TrainingArguments both trainers share."""
    return dict(output_dir=str(a.out), per_device_train_batch_size=a.batch,
                gradient_accumulation_steps=a.accum, max_steps=a.steps, learning_rate=2e-5,
                gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda,
                model_init_kwargs={"dtype": "float32"},
                teacher_model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
                report_to="none", save_strategy="no", logging_steps=a.steps, disable_tqdm=True,
                seed=0, dataloader_num_workers=0)


def distillation_trainer(a, rows: list[dict], cuda: bool, timer: HFStepTimer):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    # the prompt: the conversation before its first assistant turn (distill's rows' prompt)
    prompts = [{"prompt": r["messages"][:next(i for i, m in enumerate(r["messages"])
                                              if m["role"] == "assistant")]} for r in rows]
    cfg = DistillationConfig(**common_args(a, cuda), max_completion_length=a.new_tokens,
                             temperature=1.0, top_p=1.0, top_k=0, beta=0.5,
                             shuffle_dataset=False)
    tok = AutoTokenizer.from_pretrained(a.student, padding_side="left")
    return DistillationTrainer(model=a.student, teacher_model=a.teacher, args=cfg,
                               train_dataset=Dataset.from_list(prompts), processing_class=tok,
                               callbacks=[timer])


def gkd_trainer(a, rows: list[dict], cuda: bool, timer: HFStepTimer):
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    cfg = GKDConfig(**common_args(a, cuda), lmbda=0.0, beta=0.5, max_length=a.max_length,
                    train_sampling_strategy="sequential",
                    include_num_input_tokens_seen="non_padding")
    tok = AutoTokenizer.from_pretrained(a.student)
    return GKDTrainer(model=a.student, teacher_model=a.teacher, args=cfg,
                      train_dataset=Dataset.from_list(rows), processing_class=tok,
                      callbacks=[timer])


TRAINERS = {"distillation": distillation_trainer, "gkd": gkd_trainer}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=sorted(TRAINERS), required=True)
    p.add_argument("--student", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--data", type=Path, required=True, help="a jsonl of chat `messages` rows")
    p.add_argument("--timer", required=True, help="where the StepTimer JSON goes")
    p.add_argument("--out", type=Path, required=True, help="the trainer's output_dir")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="rows per micro-batch")
    p.add_argument("--accum", type=int, required=True, help="micro-batches per step")
    p.add_argument("--new-tokens", type=int, default=128, help="distillation: sampled tokens")
    p.add_argument("--max-length", type=int, default=2048, help="gkd: the longest row")
    a = p.parse_args(argv)
    rows = [json.loads(line) for line in a.data.read_text().splitlines() if line.strip()]
    cuda = torch.cuda.is_available()
    timer = HFStepTimer(a.timer, a.warmup)
    trainer = TRAINERS[a.trainer](a, rows, cuda, timer)
    trainer.train()
    record = json.loads(Path(a.timer).read_text())
    record["setup"] = setup(trainer)
    Path(a.timer).write_text(json.dumps(record, indent=1))
    return 0


def setup(trainer) -> dict:
    """What the trainer ran with, read back from it: the job's fixed choices, checked."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"student_dtype": str(next(model.parameters()).dtype),
            "teacher_dtype": str(next(trainer.teacher_model.parameters()).dtype),
            "gradient_checkpointing": bool(model.is_gradient_checkpointing),
            "bf16_autocast": bool(trainer.args.bf16), "optimizer": trainer.args.optim,
            "trl": __import__("trl").__version__}


if __name__ == "__main__":
    sys.exit(main())
