"""Examples -> token ids and labels (HF convention: labels aligned with input_ids, -100
where not trained; the model-side shift happens in the module).

SFT trains only the assistant tokens, found with the chat template's `{% generation %}`
markers (`return_assistant_tokens_mask`). CPT trains every token of the text.
"""

from __future__ import annotations

IGNORE_INDEX = -100


def tokenize_sft(messages, tokenizer, max_length: int) -> dict:
    enc = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(enc["input_ids"])[:max_length]
    mask = list(enc["assistant_masks"])[:max_length]
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    return {"input_ids": ids, "labels": labels}


def tokenize_cpt(text: str, tokenizer, max_length: int) -> dict:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    ids = ids[:max_length]
    return {"input_ids": ids, "labels": list(ids)}


def tokenize_source(ds, source: dict, tokenizer, max_length: int):
    """Map one raw source to input_ids / labels / example_id; refuse it if nothing trains."""
    kind = source.get("kind", "sft")
    field = source.get("field", "messages" if kind == "sft" else "text")
    name = source.get("name", str(source.get("path")))

    def encode(example, idx):
        if kind == "sft":
            out = tokenize_sft(example[field], tokenizer, max_length)
        else:
            out = tokenize_cpt(example[field], tokenizer, max_length)
        out["example_id"] = f"{name}:{idx}"
        return out

    tok = ds.map(encode, with_indices=True, remove_columns=ds.column_names,
                 desc=f"tokenizing {name}")
    tok = tok.filter(lambda ex: len(ex["input_ids"]) > 1)
    trained = sum(sum(1 for t in lab[1:] if t != IGNORE_INDEX) for lab in tok["labels"])
    if trained == 0:
        hint = ("the chat template must mark assistant turns with {% generation %} ... "
                "{% endgeneration %}" if kind == "sft" else "the texts are empty")
        raise ValueError(f"data source {name!r} has no trainable token after tokenization "
                         f"(max_length={max_length}): {hint}")
    return tok
