"""Accuracy of a causal LM on the demo's checkable chat tasks.

Each example is a chat (`messages`) whose last turn is the assistant's answer, plus a `task`
name and optionally a `match` rule. The model answers the prompt (every turn before the
answer, then the chat template's generation prompt) by greedy decoding; an answer counts
when it equals the reference after stripping whitespace (`"match": "exact"`, the default),
or, for `"match": "permutation"` (a task where every ordering of the letters is correct),
when it holds the reference's characters in any order. Prompts are left-padded so that a
whole batch decodes in one `model.generate` call: the cost is a few forward passes per
batch, not per example.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from distill.data.collate import pad

MATCHES = {"exact": lambda answer, reference: answer == reference,
           "permutation": lambda answer, reference: sorted(answer) == sorted(reference)}


def is_correct(answer: str, example: dict) -> bool:
    """The answer against the example's reference (its last message), by its `match` rule."""
    return MATCHES[example.get("match", "exact")](answer.strip(),
                                                   example["messages"][-1]["content"].strip())


def load_examples(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read a jsonl file of `{"messages": [...], "task": ...}` examples (the first `limit`);
    a problem names the file and the line."""
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    examples.append(_example(line, f"line {lineno} of {path}"))
                if limit is not None and len(examples) >= limit:
                    break
    except UnicodeDecodeError as err:
        raise ValueError(f"evaluate.path={path} is not UTF-8 text ({err})") from err
    return examples


def _example(line: str, where: str) -> dict:
    try:
        ex = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"evaluate.path: {where} is not valid JSON (column {err.colno}: "
                         f"{err.msg}); the task file is jsonl, one example per line") from err
    messages = ex.get("messages") if isinstance(ex, dict) else None
    if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant"
            and isinstance(messages[-1].get("content"), str)):
        raise ValueError(f"evaluate.path: {where} is not a task example: it needs `messages`, "
                         "a chat whose last turn is the assistant's reference answer (a "
                         "string), and optionally `task`")
    if ex.get("match", "exact") not in MATCHES:
        raise ValueError(f"evaluate.path: {where} has match={ex['match']!r}; the rules are "
                         f"{sorted(MATCHES)}")
    return ex


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of every turn before the final answer, ending with the generation prompt."""
    encoded = tokenizer.apply_chat_template(
        messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True
    )
    return list(encoded["input_ids"])


@torch.no_grad()
def generate_answers(
    model, tokenizer, examples: list[dict], max_new_tokens: int = 16, batch_size: int = 256
) -> list[str]:
    """Greedy answers of `model` to the prompts of `examples`, in order."""
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    prompts = [_prompt_ids(tokenizer, ex["messages"]) for ex in examples]
    # Similar lengths in one batch: less padding to run through the model.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[str] = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            input_ids, attention_mask = pad([prompts[i] for i in idx], pad_id, side="left")
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
            )  # (B, prompt + new)
            new_tokens = out[:, input_ids.shape[1] :].tolist()
            for i, tokens in zip(idx, new_tokens):
                answers[i] = tokenizer.decode(tokens, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return answers


def task_accuracy(
    model, tokenizer, examples: list[dict], max_new_tokens: int = 16, batch_size: int = 256
) -> dict:
    """Greedy accuracy on `examples`, each scored by its `match` rule (`is_correct`).

    Returns `{"overall": float, "per_task": {task: float}, "n": int}`; accuracies are
    fractions in [0, 1]. The reference answer is the content of each example's last message.
    """
    if not examples:
        raise ValueError("task_accuracy needs at least one example; got an empty list.")
    answers = generate_answers(model, tokenizer, examples, max_new_tokens, batch_size)
    hits: dict[str, list[bool]] = defaultdict(list)
    for ex, answer in zip(examples, answers):
        hits[ex.get("task", "all")].append(is_correct(answer, ex))
    everything = [h for task_hits in hits.values() for h in task_hits]
    return {
        "overall": sum(everything) / len(everything),
        "per_task": {task: sum(h) / len(h) for task, h in sorted(hits.items())},
        "n": len(everything),
    }
