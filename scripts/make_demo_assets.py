"""Build the bundled demo: checkable chat tasks, a CPT corpus, a tokenizer, a trained teacher.

    python scripts/make_demo_assets.py [--out distill/demo/assets] [--seed 0]

Everything is generated here (no downloads) and is deterministic given the seed. The tasks
(addition, string reversal, sorting, permutation) have checkable answers, so a distilled
student can be scored exactly (`distill.demo.evaluation.task_accuracy`): exact match, or for the
permutation task any ordering of the prompt's letters. The tokenizer is character level:
digits and letters are single tokens, which is what lets a model of a couple of million
parameters learn carries and reversals in minutes. The permutation task's data comes from
a generator of its own, so adding it left the other tasks' data and the tokenizer
byte-identical.

The distillation demo (`make demo`) uses the permutation task alone: its teacher answers are
graded (`permutation_answer`), which is what makes distillation pay over SeqKD there
(docs/notes/demo.md). `--demo-tasks-only` rewrites just its tasks_*.jsonl.

Needs the package importable (`pip install -e .`; run from a worktree, put it first on
PYTHONPATH). The teacher's 6000 steps of batch 64 cost about 0.2 s each on one CPU core
(about 20 minutes in all; more on busy cores). The committed teacher was trained on a CPU
with `--threads 1`, seed 0, the other arguments at their defaults, and scores 0.98 on the
test splits after reloading in float32 (addition 0.90, reversal 1.0, sorting 1.0,
permutation 0.99).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import string
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from distill.demo.evaluation import task_accuracy

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]

# The answer and its closing eos sit inside {% generation %}, so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly the tokens
# a model must learn to produce, the stop token included.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>' -}}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- elif message['role'] in ['system', 'user'] -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] -}}"
    "{%- else -%}"
    "{{- raise_exception('demo chat template: roles are system, user, assistant; got '"
    " + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

TEACHER = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=384,
)
STUDENT = dict(
    hidden_size=96,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=3,
    intermediate_size=256,
)
MAX_POSITIONS = 128


# ---------------------------------------------------------------- tasks


def addition(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(10, 999)
    b = rng.randint(10, 999)
    return f"add {a}+{b}", str(a + b)


def reversal(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8)))
    return f"reverse {word}", word[::-1]


def sorting(rng: random.Random) -> tuple[str, str]:
    alphabet = string.digits if rng.random() < 0.5 else string.ascii_lowercase
    items = "".join(rng.choices(alphabet, k=rng.randint(3, 8)))
    return f"sort {items}", "".join(sorted(items))


def preferred_order(letters: str) -> str:
    """The teacher's style for the permutation task: the smaller half of the letters in
    alphabetical order, then the others as they come from the right end of the prompt."""
    small = set(sorted(letters)[: (len(letters) + 1) // 2])
    return "".join(sorted(small)) + "".join(c for c in reversed(letters) if c not in small)


def permutation(rng: random.Random, lengths: tuple[int, int]) -> tuple[str, str]:
    """Distinct letters to write in any order: every ordering is a correct answer. The
    returned answer is the teacher's preferred one (`preferred_order`), which the test
    split stores as its reference (scored with `"match": "permutation"`)."""
    letters = "".join(rng.sample(string.ascii_lowercase, rng.randint(*lengths)))
    return f"permute {letters}", preferred_order(letters)


def permutation_answer(rng: random.Random, letters: str, mix: tuple[float, float]) -> str:
    """A training answer of the permutation task, drawn from its graded answer distribution:
    the preferred order with probability mix[0], alphabetical order with mix[1], else a
    uniformly random order. A teacher trained on these answers writes the preferred order
    greedily, but its distribution keeps the alphabetical order as a strong second choice
    at the step where the two part (and a little mass on every letter still to write)."""
    u = rng.random()
    if u < mix[0]:
        return preferred_order(letters)
    if u < mix[0] + mix[1]:
        return "".join(sorted(letters))
    return "".join(rng.sample(letters, len(letters)))


TASKS = {"addition": addition, "reversal": reversal, "sorting": sorting}
# The distillation demo (conf/experiment/onpolicy_demo.yaml) uses the permutation task
# (docs/notes/demo.md says why); the earlier one used reversal and sorting, the
# tasks a 2-layer student learns in minutes (addition's carries stay out of its reach).
DEMO_TASKS = ("permutation",)
# how an answer is scored (distill.demo.evaluation): "permutation" accepts any ordering
MATCH = {"permutation": "permutation"}


def make_example(prompt: str, answer: str, task: str) -> dict:
    example = {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
        "task": task,
    }
    if task in MATCH:
        example["match"] = MATCH[task]
    return example


def permutation_splits(rng: random.Random, sizes: dict[str, int], args,
                       seen: set[str]) -> dict:
    """Unique permutation prompts per split. Train and val answers are drawn from the task's
    answer distribution (`--perm-mix`); test stores the preferred answer and
    `"match": "permutation"` (any ordering counts)."""
    splits = {}
    for split, size in sizes.items():
        examples = []
        while len(examples) < size:
            prompt, preferred = permutation(rng, tuple(args.perm_lengths))
            if prompt in seen:
                continue
            seen.add(prompt)
            answer = preferred if split == "test" else permutation_answer(
                rng, prompt.split(" ")[1], tuple(args.perm_mix))
            examples.append(make_example(prompt, answer, "permutation"))
        splits[split] = examples
    return splits


def make_sft_splits(rng: random.Random, n_train: int, n_val: int, n_test: int,
                    tasks=tuple(TASKS), seen: set[str] | None = None) -> dict:
    """Unique prompts, balanced over the tasks; val and test never appear in train (nor do
    any of the prompts in `seen`)."""
    seen = set() if seen is None else seen
    splits = {}
    for split, size in [("test", n_test), ("val", n_val), ("train", n_train)]:
        examples = []
        while len(examples) < size:
            task = tasks[len(examples) % len(tasks)]
            prompt, answer = TASKS[task](rng)
            if prompt not in seen:
                seen.add(prompt)
                examples.append(make_example(prompt, answer, task))
        rng.shuffle(examples)
        splits[split] = examples
    return splits


def cpt_document(rng: random.Random) -> str:
    """One line of plain text: a worked task in words, or a templated sentence."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return f"{a} plus {b} is {a + b}."
    if kind == 1:
        _, word = reversal(rng)
        return f"the word {word[::-1]} read backwards is {word}."
    if kind == 2:
        prompt, answer = sorting(rng)
        return f"in order, {prompt.split()[1]} becomes {answer}."
    names = ["ada", "bob", "cy", "dee", "eli", "fay"]
    things = ["apples", "books", "coins", "pens", "shells", "stamps"]
    n, m = rng.randint(1, 20), rng.randint(1, 20)
    who, what = rng.choice(names), rng.choice(things)
    return f"{who} had {n} {what} and found {m} more, so {who} has {n + m} {what}."


def make_cpt_split(rng: random.Random, size: int, exclude: set[str]) -> list[str]:
    lines: list[str] = []
    while len(lines) < size:
        line = cpt_document(rng)
        if line not in exclude:
            exclude.add(line)
            lines.append(line)
    return lines


def write_demo_tasks(out: Path, teacher_splits: dict, args) -> None:
    """The distillation demo's data: a few labelled chats, many prompts without an answer
    (`kind: prompts`), val and test; all new prompts (none in the teacher's data).

    This is the semi-supervised setting where distillation pays off: the hard labels
    cover only `--n-labeled` examples, while the teacher can score the student's answers
    to every prompt (on-policy)."""
    seen = {ex["messages"][0]["content"] for split in teacher_splits.values() for ex in split}
    rng = random.Random(args.seed + 1)
    demo = {"test": [], "val": [], "train": []}
    old = tuple(t for t in args.demo_tasks if t in TASKS)
    if old:
        demo = make_sft_splits(rng, args.n_labeled + args.n_prompts, args.n_eval, args.n_eval,
                               tasks=old, seen=seen)
    if "permutation" in args.demo_tasks:
        share = 1 / len(args.demo_tasks)
        sizes = {"test": round(args.n_eval * share), "val": round(args.n_eval * share),
                 "train": round((args.n_labeled + args.n_prompts) * share)}
        if old:  # make_sft_splits balanced the old tasks over the whole split sizes
            demo = {k: v[: len(v) - sizes[k]] for k, v in demo.items()}
        lengths = argparse.Namespace(**{**vars(args), "perm_lengths": args.demo_perm_lengths
                                         or args.perm_lengths})
        for split, examples in permutation_splits(rng, sizes, lengths, seen).items():
            demo[split] = demo[split] + examples
            rng.shuffle(demo[split])
    labeled, prompts = demo["train"][: args.n_labeled], demo["train"][args.n_labeled :]
    write_jsonl(out / "data" / "tasks_labeled.jsonl", labeled)
    write_jsonl(out / "data" / "tasks_prompts.jsonl",
                [{"messages": ex["messages"][:1], "task": ex["task"]} for ex in prompts])
    write_jsonl(out / "data" / "tasks_val.jsonl", demo["val"])
    write_jsonl(out / "data" / "tasks_test.jsonl", demo["test"])
    print(f"demo tasks: {len(labeled)} labelled, {len(prompts)} prompts, "
          f"{args.n_eval} val, {args.n_eval} test")


def write_jsonl(path: Path, examples: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex) + "\n")


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character of the corpus is one token."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(
        vocab_size=512, min_frequency=1, special_tokens=SPECIAL_TOKENS
    )
    tok.train_from_iterator(texts, trainer)
    # Plain text (CPT) gets a bos like Llama's tokenizers; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )


def check_assistant_mask(tokenizer, example: dict) -> None:
    """Fail loudly unless the template's mask covers exactly the answer and its eos."""
    enc = tokenizer.apply_chat_template(
        example["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    marked = [t for t, m in zip(ids, mask) if m]
    expected = tokenizer(example["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
    if marked != expected + [tokenizer.eos_token_id] or mask[-len(marked) :] != [1] * len(marked):
        raise RuntimeError(
            f"assistant mask is wrong: {tokenizer.convert_ids_to_tokens(ids)} mask {mask}"
        )


# ---------------------------------------------------------------- teacher


def llama_config(tokenizer, sizes: dict) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sizes,
    )


def encode_corpus(tokenizer, sft: list[dict], cpt: list[str]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, trained-mask) rows: SFT trains the answer tokens, CPT every token."""
    rows = []
    enc = tokenizer.apply_chat_template(
        [ex["messages"] for ex in sft],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    rows += list(zip(enc["input_ids"], enc["assistant_masks"]))
    for line in cpt:
        ids = tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((ids, [0] + [1] * (len(ids) - 1)))
    return rows


def collate(rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        t = torch.tensor(ids)
        input_ids[i, : len(ids)] = t
        attention[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, -100)
    return input_ids, attention, labels


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(rows, batch_size: int, rng: random.Random):
    """Endless shuffled batches; rows of similar length share a batch (less padding)."""
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        pool = batch_size * 16
        for start in range(0, len(order) - pool + 1, pool):
            chunk = sorted(order[start : start + pool], key=lambda i: len(rows[i][0]))
            groups = [chunk[i : i + batch_size] for i in range(0, pool, batch_size)]
            rng.shuffle(groups)
            for group in groups:
                yield [rows[i] for i in group]


def train_teacher(model, rows, args, tokenizer, val: list[dict]) -> float:
    """Plain next-token cross-entropy on the trained positions; returns wall seconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.1)
    stream = batches(rows, args.batch_size, random.Random(args.seed))
    start = time.time()
    model.train()
    for step in range(args.steps):
        input_ids, _, labels = collate(next(stream), tokenizer.pad_token_id)
        input_ids, labels = input_ids.to(args.device), labels.to(args.device)
        # Padding is on the right and causal attention never looks ahead, so real tokens
        # never see it: no attention mask needed, and SDPA keeps its fast causal path.
        # on a GPU, bf16 autocast (fp32 weights and optimizer); the CPU teacher is pure fp32
        with torch.autocast("cuda", torch.bfloat16, enabled=args.device.startswith("cuda")):
            logits = model(input_ids=input_ids).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == args.steps - 1:
            elapsed = time.time() - start
            print(f"step {step:5d}  loss {loss.item():.4f}  {elapsed:6.0f}s", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            print(f"  val {task_accuracy(model, tokenizer, val, args.eval_tokens)}", flush=True)
            model.train()
    return time.time() - start


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="distill/demo/assets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=30000)
    p.add_argument("--n-eval", type=int, default=201, help="size of val and of test")
    p.add_argument("--n-cpt", type=int, default=3000)
    p.add_argument("--n-labeled", type=int, default=128,
                   help="labelled chats of the distillation demo (tasks_labeled.jsonl)")
    p.add_argument("--n-prompts", type=int, default=20000,
                   help="prompt-only rows of the distillation demo (tasks_prompts.jsonl)")
    p.add_argument("--demo-tasks-only", action="store_true",
                   help="only rewrite the distillation demo's tasks_*.jsonl (keeps the teacher)")
    p.add_argument("--demo-tasks", nargs="+", default=list(DEMO_TASKS),
                   choices=[*TASKS, "permutation"], help="the distillation demo's tasks")
    p.add_argument("--n-perm", type=int, default=20000,
                   help="permutation chats in the teacher's training data (on top of --n-train)")
    p.add_argument("--perm-lengths", type=int, nargs=2, default=[4, 12],
                   help="letters per permutation prompt (min max)")
    p.add_argument("--demo-perm-lengths", type=int, nargs=2, default=[7, 12],
                   help="letters per permutation prompt of the distillation demo's data "
                        "(default: --perm-lengths)")
    p.add_argument("--perm-mix", type=float, nargs=2, default=[0.55, 0.35],
                   help="shares of the permutation training answers in the preferred and in "
                        "alphabetical order (the rest: random orders)")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-tokens", type=int, default=16,
                   help="greedy tokens per answer when the teacher is scored")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--teacher",
        type=json.loads,
        default={},
        help="JSON overrides of the teacher config, e.g. '{\"hidden_size\": 192}'",
    )
    p.add_argument("--student", type=json.loads, default={},
                   help="JSON overrides of the student config (written, not trained)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    splits = make_sft_splits(rng, args.n_train, args.n_eval, args.n_eval)
    # the permutation task comes from a generator of its own, so that the other tasks' data
    # and the tokenizer (trained on their texts) stay what they were before it was added
    perm = permutation_splits(random.Random(args.seed + 2),
                              {"test": args.n_eval, "val": args.n_eval, "train": args.n_perm},
                              args, set())
    teacher_splits = {k: splits[k] + perm[k] for k in splits}
    if args.demo_tasks_only:
        write_demo_tasks(out, teacher_splits, args)
        return
    if out.exists():
        shutil.rmtree(out)
    for split, examples in splits.items():
        write_jsonl(out / "data" / f"sft_{split}.jsonl", examples)
    write_demo_tasks(out, teacher_splits, args)
    seen: set[str] = set()
    cpt = {
        "train": make_cpt_split(rng, args.n_cpt, seen),
        "val": make_cpt_split(rng, max(1, args.n_cpt // 10), seen),
    }
    for split, lines in cpt.items():
        (out / "data" / f"cpt_{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")

    texts = [m["content"] for ex in splits["train"] for m in ex["messages"]] + cpt["train"]
    tokenizer = train_tokenizer(texts)
    check_assistant_mask(tokenizer, splits["test"][0])
    tokenizer.save_pretrained(out / "tokenizer")
    print(f"tokenizer: {len(tokenizer)} tokens")

    model = LlamaForCausalLM(llama_config(tokenizer, {**TEACHER, **args.teacher})).to(args.device)
    print(f"teacher: {model.num_parameters() / 1e6:.2f}M parameters")
    rows = encode_corpus(tokenizer, splits["train"] + perm["train"], cpt["train"])
    seconds = train_teacher(model, rows, args, tokenizer, splits["val"][:60] + perm["test"][:60])
    model.cpu().save_pretrained(out / "teacher")
    tokenizer.save_pretrained(out / "teacher")

    reloaded = LlamaForCausalLM.from_pretrained(out / "teacher", dtype=torch.float32)
    print(
        f"teacher trained in {seconds / 60:.1f} min; test accuracy after reload: "
        f"{task_accuracy(reloaded, tokenizer, splits['test'] + perm['test'], args.eval_tokens)}"
    )

    student = llama_config(tokenizer, {**STUDENT, **args.student})
    student.save_pretrained(out / "student")
    tokenizer.save_pretrained(out / "student")
    print(f"student: {LlamaForCausalLM(student).num_parameters() / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
