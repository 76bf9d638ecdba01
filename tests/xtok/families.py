"""Tiny but real tokenizers of three families, trained here on a small corpus (no download):

- qwen:   byte-level BPE, NFC normalizer, Qwen2's split regex (one digit a token), ChatML
- llama3: byte-level BPE, Llama-3's split regex (up to three digits a token), header blocks
- gemma:  SentencePiece-style BPE ("▁" for spaces, <0xHH> byte fallback), Gemma turns

Each is saved with save_pretrained and loaded back with AutoTokenizer, as a user's is. Their
vocabularies and merges differ, so the same text splits differently: numbers (Qwen's digits
against Llama's triples), words the smaller vocabularies lack, spaces before words.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.data.templates import CHATML, GEMMA, LLAMA3

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

CORPUS = [
    "Sure, 12 + 30 = 42. The answer is 42.",
    "Hello there! How are you today? I am fine, thank you.",
    "line one\nline two\nline three",
    "Paragraph one.\n\nParagraph two.",
    "Title\n\nBody\n\nEnd",
    "The sum of 123 and 456 is 579; their product is 56088.",
    "Café au lait, naïve résumé, 日本語のテキスト.",
    "def add(a, b):\n    return a + b\n",
    "You are a helpful assistant. Be brief and precise.",
    "system user assistant model header text",
]

FAMILIES = {
    # name: (template, specials, bos, eos (end of turn), pad, vocab size)
    "qwen": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>",
             "<|endoftext|>", 420),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>",
               "<|end_of_text|>", 380),
    "gemma": (GEMMA, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>",
              "<end_of_turn>", "<pad>", 360),
}


def _byte_level(split: str, nfc: bool) -> Tokenizer:
    core = Tokenizer(models.BPE())
    if nfc:
        core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    return core


def _train(core: Tokenizer, size: int, specials: list[str], alphabet) -> Tokenizer:
    core.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(
        vocab_size=size, special_tokens=specials, initial_alphabet=alphabet,
        show_progress=False))
    return core


def _sentencepiece_like(size: int, specials: list[str]) -> Tokenizer:
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.Replace(" ", "\u2581")
    # words start at "▁"; a newline stays its own piece (as in Gemma's vocabulary)
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Split("\u2581", behavior="merged_with_next")])
    _train(core, size, specials, [])
    # byte fallback as SentencePiece has it: <0xHH> pieces for what the merges cannot spell
    model = json.loads(core.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    fresh = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    fresh.normalizer = core.normalizer
    fresh.pre_tokenizer = core.pre_tokenizer
    fresh.add_special_tokens(specials)
    fresh.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                       decoders.Fuse()])
    return fresh


def make_family_tokenizer(name: str, path: Path):
    template, specials, bos, eos, pad, size = FAMILIES[name]
    if name == "gemma":
        core = _sentencepiece_like(size, specials)
    else:
        core = _byte_level(QWEN2_SPLIT if name == "qwen" else LLAMA3_SPLIT, nfc=name == "qwen")
        _train(core, size, specials, pre_tokenizers.ByteLevel.alphabet())
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos,
                                  pad_token=pad, additional_special_tokens=specials)
    tok.chat_template = template
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
