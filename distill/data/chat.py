"""Chat template -> token ids and assistant-only labels, for any template.

Where the template marks assistant turns with `{% generation %}` we use the marks. Most
real templates (Qwen2.5 ChatML, Llama-3, Mistral, Gemma) carry none, so the spans are
derived from the template itself: for the assistant turn at index i,

    P = tokens(render(messages[:i], add_generation_prompt=True))   what the model is given
    D = tokens(render(messages[:i + 1]))                            ... plus what it writes

P must be a token prefix of D, and the trained span is D[len(P):]: exactly the tokens the
model produces at inference after that prompt, its end-of-turn token included. Whitespace
the template writes after that special token (ChatML's and Gemma's "\n") is not trained:
generation stops at the end-of-turn token and never produces it.

All turns are trained in one example when every D is a prefix of the last one. A template
that rewrites earlier turns (Qwen3 drops the <think> block of assistant turns before the
last user turn) breaks that; each assistant turn then becomes its own example, rendered as
the model sees it at inference and trained on that turn only. A template whose rendered P
is not a prefix of D is refused: no label can say what the model writes there. When only
the tokens disagree (the tokenizer merges the prompt's last token with the answer's first,
which depends on the answer), the row is dropped and counted instead (MergedBoundary).
"""

from __future__ import annotations

import re
from pathlib import Path

from distill.core.constants import IGNORE_INDEX

MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


class TemplateError(ValueError):
    """The chat template cannot give assistant-only labels; the message says why."""


class MergedBoundary(TemplateError):
    """The tokenizer merges the generation prompt's last token with the answer's first (an
    answer that starts with a newline after a prompt that ends with one): the row is dropped
    and counted; a template for which every row does so is refused."""


def resolve_template(chat_template: str | None) -> str | None:
    """`data.chat_template`: a template string, or the path of a .jinja / .txt file."""
    if chat_template is None or "{" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.chat_template={chat_template!r} is neither a Jinja "
                                "template (no '{{' or '{%') nor an existing file")
    return path.read_text(encoding="utf-8")


class ChatEncoder:
    """Renders and tokenizes conversations with one template; see the module docstring."""

    def __init__(self, tokenizer, chat_template: str | None = None,
                 assistant_turns: str = "all", template_kwargs: dict | None = None):
        if assistant_turns not in ("all", "last"):
            raise ValueError(f"data.assistant_turns must be 'all' or 'last', got "
                             f"{assistant_turns!r}")
        template = resolve_template(chat_template) or tokenizer.chat_template
        if isinstance(template, dict):  # several named templates: the default one is chat
            template = template.get("default")
        if not template:
            raise TemplateError("the tokenizer has no chat template: set data.chat_template= "
                                "to a template string or a .jinja file")
        self.tokenizer, self.template = tokenizer, template
        self.kwargs = dict(template_kwargs or {})  # e.g. enable_thinking, date_string
        self.last_only = assistant_turns == "last"
        self.markers = bool(MARKER.search(template))
        self.special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.rewrites = False  # set once a conversation needed one example per turn

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False,
            add_generation_prompt=generation_prompt, **self.kwargs)

    def tokens(self, texts: list[str]) -> list[list[int]]:
        # the template writes its own bos; the tokenizer must not add another
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def prompt(self, messages: list[dict]) -> list[int]:
        """The tokens the model is given to answer `messages` (generation prompt included)."""
        return self.tokens([self.render(messages, True)])[0]

    def examples(self, messages: list[dict]) -> list[tuple[list[int], list[int]]]:
        """(input_ids, labels) per example; [] when there is no assistant turn."""
        texts, finish = self.plan(messages)
        return finish(self.tokens(texts) if texts else [])

    def plan(self, messages: list[dict]):
        """(texts to tokenize, finish(their tokens) -> examples): a batch of rows then needs
        one tokenizer call, which the fast tokenizers spread over the CPU cores."""
        calls = next((k for k, m in enumerate(messages) if m.get("tool_calls")), None)
        if calls is not None and "tool_calls" not in self.template:
            raise TemplateError(f"its message {calls} (from 0) has tool_calls, but the chat "
                                "template never renders tool calls (it does not mention "
                                "tool_calls): they would vanish from the text the model trains "
                                "on. Set data.chat_template= to the template of a model with "
                                "tool support, or leave the tool turns out of the data")
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            return [], lambda toks: []
        if self.last_only:
            turns = turns[-1:]
        if self.markers:
            return [], lambda toks: [self._marked(messages, turns)]
        texts = [self.render(messages[:i + g], not g) for i in turns for g in (0, 1)]
        return texts, lambda toks: self._split(turns, texts, toks)

    def _split(self, turns: list[int], texts: list[str], toks: list[list[int]]):
        pairs = [(toks[2 * k], toks[2 * k + 1], texts[2 * k], texts[2 * k + 1])
                 for k in range(len(turns))]
        spans = [self._span(p, d, tp, td, i) for i, (p, d, tp, td) in zip(turns, pairs)]
        last = pairs[-1][1]
        if all(last[:len(d)] == d for _, d, _, _ in pairs):
            return [_labelled(last, spans)]
        self.rewrites = True  # earlier turns render differently once later ones follow
        return [_labelled(d, [s]) for (_, d, _, _), s in zip(pairs, spans)]

    def _span(self, p: list[int], d: list[int], text_p: str, text_d: str, i: int):
        """[start, end) of the tokens the model writes for assistant turn i."""
        if not text_d.startswith(text_p):
            cut = next(k for k, (a, b) in enumerate(zip(text_p, text_d + "\0")) if a != b)
            raise TemplateError(
                f"the chat template is not prefix-stable: the prompt it renders for assistant "
                f"turn {i} (generation prompt included) is not the start of that turn rendered "
                f"whole; they differ at character {cut}: {text_p[cut:cut + 30]!r} vs "
                f"{text_d[cut:cut + 30]!r}. Fix the template or set data.chat_template=")
        if d[:len(p)] != p:
            raise MergedBoundary(
                f"the tokenizer merges the end of the generation prompt with the start of "
                f"assistant turn {i} ({text_d[max(0, len(text_p) - 10):len(text_p) + 10]!r}): "
                "the prompt's tokens are not a prefix of the turn's, so the tokens the model "
                "writes after the prompt are not defined")
        end = k = len(d)
        while k > len(p) and self._blank(d[k - 1]):
            k -= 1
        if len(p) < k < end and d[k - 1] in self.special:
            end = k  # the blank tail after the end-of-turn token is never generated
        return len(p), end

    def _blank(self, token: int) -> bool:
        return token not in self.special and not self.tokenizer.decode([token]).strip()

    def _marked(self, messages: list[dict], turns: list[int]):
        """The template's own {% generation %} marks; with `last`, only the last marked run."""
        end = turns[-1] + 1
        enc = self.tokenizer.apply_chat_template(
            messages[:end], chat_template=self.template, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, **self.kwargs)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        if self.last_only and any(mask):
            stop = max(k for k, m in enumerate(mask) if m) + 1
            start = stop
            while start > 0 and mask[start - 1]:
                start -= 1
            mask = [int(start <= k < stop) for k in range(len(mask))]
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def _labelled(ids: list[int], spans) -> tuple[list[int], list[int]]:
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        labels[start:end] = ids[start:end]
    return ids, labels
