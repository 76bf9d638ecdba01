"""The template matrix on a byte-level BPE tokenizer with a Llama-3 / Qwen2-style split
regex (trained here on a few sentences): merges like real tokenizers', so a boundary that
only a character tokenizer keeps apart would show here. Trained runs are decoded and
compared with the assistant texts."""

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from distill.data.chat import ChatEncoder, MergedBoundary
from tests.data.templates import QWEN3, SPECIALS, TEMPLATES
from tests.data.test_templates import LEAD

SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["Sure, 12 + 30 = 42.", "Hello there! How are you today?", "line one\nline two\n",
          "The answer is: yes.", "system user assistant model", " Sure thing\n\n"] * 20
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": "Sure, 12 + 30 = 42."},
            {"role": "user", "content": "Two lines?"},
            {"role": "assistant", "content": "line one\nline two"}]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                            bos_token="<s>", eos_token="</s>",
                            additional_special_tokens=SPECIALS[4:]).save_pretrained(path)
    return path


def runs(tok, ids, labels):
    out, current = [], None
    for t, y in zip(ids, labels):
        if y == -100:
            current = None
            continue
        if current is None:
            current = []
            out.append(current)
        current.append(t)
    return [tok.decode(r) for r in out]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_byte_level_bpe_matrix(bpe, name):
    template, bos, eot = TEMPLATES[name]
    tok = AutoTokenizer.from_pretrained(bpe)
    tok.bos_token = bos or "<s>"
    [(ids, labels)] = ChatEncoder(tok, chat_template=template).examples(MESSAGES)
    lead = LEAD.get(name, "")
    assert runs(tok, ids, labels) == [lead + "Sure, 12 + 30 = 42." + eot,
                                      lead + "line one\nline two" + eot]
    assert len(ids) < len(tok.decode(ids))  # merges happened: not one token a character


def test_byte_level_bpe_qwen3_and_a_leading_newline(bpe):
    tok = AutoTokenizer.from_pretrained(bpe)
    msgs = [MESSAGES[1], {"role": "assistant", "content": "<think>\nadd\n</think>\n\n 42."}]
    [(ids, labels)] = ChatEncoder(tok, chat_template=QWEN3).examples(msgs)
    assert runs(tok, ids, labels) == ["<think>\nadd\n</think>\n\n 42.<|im_end|>"]
    # ChatML's prompt ends with "\n": an answer that starts with "\n" merges into "\n\n"
    chatml = ChatEncoder(tok, chat_template=TEMPLATES["chatml"][0])
    with pytest.raises(MergedBoundary, match="merges the end of the generation prompt"):
        chatml.examples([MESSAGES[1], {"role": "assistant", "content": "\nSure"}])
    [(ids, labels)] = chatml.examples([MESSAGES[1], {"role": "assistant", "content": " Sure"}])
    assert runs(tok, ids, labels) == [" Sure<|im_end|>"]
