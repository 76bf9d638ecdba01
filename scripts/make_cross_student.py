"""A demo student with a tokenizer of its own, for the cross-tokenizer demo comparison.

    python scripts/make_cross_student.py --out /tmp/xstudent [--vocab 42]

The bundled teacher reads one character per token (47 tokens). This student's tokenizer is a
SentencePiece-style BPE trained on the demo's prompts and answers, with the same special
tokens and chat template: at the default 42 tokens, the letters, a word-start mark and
"▁permute" as one token, so its ids, its vocabulary and its segmentation of the prompt and
of every space differ from the teacher's while each letter stays a token of its own. More
tokens (`--vocab 400`) merge letters into pieces ("pf", "wm"), which the demo's 2-layer
student did not learn to take apart in 1000 steps (0% for every arm; docs/notes/demo.md).
The folder holds that tokenizer and a config of the demo student's shape with this
vocabulary; `student.from_scratch=true` (student=demo) initializes it. Run it with

    python -m distill.train +experiment=onpolicy_demo student.name_or_path=/tmp/xstudent \
        loss.cross_tokenizer=hybrid
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "distill" / "demo" / "assets" / "data"


def demo_assets_script():
    spec = importlib.util.spec_from_file_location("make_demo_assets",
                                                  ROOT / "scripts" / "make_demo_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def texts() -> list[str]:
    """The demo's chat texts (prompts and labelled answers), the BPE's training corpus."""
    out = []
    for name in ["tasks_labeled", "tasks_prompts", "tasks_val"]:
        for line in (DATA / f"{name}.jsonl").open():
            out += [m["content"] for m in json.loads(line)["messages"]]
    return out


def train_bpe(corpus: list[str], vocab: int, assets) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # SentencePiece-style word-start marks (a text after a special token starts with one, as
    # in Llama-2's tokenizer: decoding puts a space there)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=assets.SPECIAL_TOKENS,
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=assets.CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        model_max_length=assets.MAX_POSITIONS)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab", type=int, default=42)
    args = p.parse_args(argv)
    assets = demo_assets_script()
    tokenizer = train_bpe(texts(), args.vocab, assets)
    example = json.loads((DATA / "tasks_labeled.jsonl").open().readline())
    assets.check_assistant_mask(tokenizer, example)
    tokenizer.save_pretrained(args.out)
    assets.llama_config(tokenizer, assets.STUDENT).save_pretrained(args.out)
    print(f"student tokenizer: {len(tokenizer)} tokens; e.g. "
          f"{tokenizer.tokenize(example['messages'][0]['content'])}")


if __name__ == "__main__":
    main()
