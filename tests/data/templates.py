"""Chat templates written in the style of the families people use, and a tokenizer that
knows their special tokens (a character-level WordLevel model: every character one token,
so a decoded span is exactly the text it covers).

None of these is a copy of a shipped template; each reproduces the traits that matter for
masks: where the bos sits, what the generation prompt is, which token ends a turn and what
whitespace follows it, how a system turn is handled, and (QWEN3) rewriting earlier turns.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<bos>", "<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]", "<|end|>",
            "<|assistant|>", "<|user|>"]

CHATML = (  # Qwen2.5: a default system turn, "\n" after <|im_end|>
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
LLAMA3 = (  # bos once, header blocks, contents trimmed, <|eot_id|> with nothing after
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
MISTRAL = (  # system folded into the first user turn, answers end with </s>
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] + '\n\n' %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for m in rest %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant') }}{%- endif %}"
    "{%- if m['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.first else '') + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
MISTRAL_LAST_SYSTEM = (  # newer Mistral style: the system text joins the LAST user turn, so
    # it moves when a turn is added (a rewriting template, like QWEN3)
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] + '\n\n' %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in rest %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for m in rest %}"
    "{%- if m['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.index0 == ns.last_user else '') + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
GEMMA = (  # no system role (folded into the first user turn), the assistant is "model"
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first = messages[0]['content'] + '\n\n' %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- for m in rest %}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
MARKED = (  # {% generation %} marks, like the demo's
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|assistant|>' }}"
    "{%- generation %}{{- m['content'] + '<|end|>' }}{%- endgeneration %}"
    "{%- else %}{{- '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
QWEN3 = (  # keeps <think> only for assistant turns after the last user turn
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set answer = m['content'].split('</think>')[-1].lstrip('\n') %}"
    "{%- set thought = m['content'].split('</think>')[0].split('<think>')[-1].strip('\n')"
    " if '</think>' in m['content'] else '' %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + answer"
    " + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + answer + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)

# name -> (template, bos, end-of-turn token, the text it writes after that token)
TEMPLATES = {
    "chatml": (CHATML, None, "<|im_end|>"),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
    "gemma": (GEMMA, "<bos>", "<end_of_turn>"),
    "marked": (MARKED, None, "<|end|>"),
}


def make_chat_tokenizer(path: Path, template: str, bos: str | None = None):
    """A character tokenizer with every special token above, saved and loaded back through
    AutoTokenizer.from_pretrained (the path a user's tokenizer takes)."""
    chars = string.ascii_letters + string.digits + " +=-.,?!:'\n_/<>|[]()"
    vocab = {t: i for i, t in enumerate(SPECIALS + list(dict.fromkeys(chars)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    eos = {"<|begin_of_text|>": "<|eot_id|>", "<bos>": "<end_of_turn>"}.get(bos, "</s>")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  bos_token=bos or "<s>", eos_token=eos,
                                  additional_special_tokens=SPECIALS[4:])
    tok.chat_template = template
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
