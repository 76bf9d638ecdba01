"""The LightningDataModule: sources -> tokenized datasets -> padded batches.

Several training sources are mixed with `datasets.interleave_datasets` by their weights
(e.g. SFT chat data with CPT text); validation sources are concatenated. With
`packing=True` the training examples are packed several per row (distill.data.pack).
"""

from __future__ import annotations

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from distill.data.chat import resolve_template
from distill.data.collate import PadCollator
from distill.data.pack import pack_dataset
from distill.data.sources import load_source
from distill.data.tokenize import tokenize_source


def build_dataset(sources, tokenizer, max_length: int, seed: int, mix: bool = True,
                  stopping_strategy: str = "first_exhausted", **options):
    """Tokenized sources, mixed by weight (or concatenated). `options`: chat_template,
    assistant_turns, cpt_stride, chat_template_kwargs, num_proc (distill.data.tokenize)."""
    parts = [tokenize_source(load_source(s), s, tokenizer, max_length, **options)
             for s in sources]
    if len(parts) == 1:
        return parts[0]
    if not mix:
        return datasets.concatenate_datasets(parts)
    weights = [float(s.get("weight", 1.0)) for s in sources]
    total = sum(weights)
    return datasets.interleave_datasets(parts, probabilities=[w / total for w in weights],
                                        seed=seed, stopping_strategy=stopping_strategy)


def check_packing_support() -> None:
    """Packed rows rely on transformers building per-document masks from position_ids;
    older versions build one causal mask over the whole row, without any error."""
    import transformers

    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"data.packing=true needs a transformers that masks packed documents apart "
            f"from their position_ids (masking_utils.find_packed_sequence_indices); this is "
            f"{transformers.__version__}: upgrade transformers or set data.packing=false"
        ) from err


class DistillDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, train: list, val: list | None = None, batch_size: int = 8,
                 val_batch_size: int | None = None, max_length: int = 512,
                 num_workers: int = 0, seed: int = 0, shuffle: bool = True,
                 pad_to_multiple_of: int = 1, packing: bool = False,
                 chat_template: str | None = None, assistant_turns: str = "all",
                 cpt_stride: int | None = None, chat_template_kwargs: dict | None = None,
                 num_proc: int | None = None, mix_stopping: str = "first_exhausted"):
        super().__init__()
        if not train:
            raise ValueError("data.train lists no source: add at least one {kind, path}")
        if chat_template is not None:
            # the evaluation and the exported tokenizer then use the template the student
            # was trained with
            tokenizer.chat_template = chat_template = resolve_template(chat_template)
        self.tokenizer = tokenizer
        self.train_sources, self.val_sources = list(train), list(val or [])
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.max_length, self.num_workers, self.seed = max_length, num_workers, seed
        self.shuffle, self.packing = shuffle, packing
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"data.max_length={max_length!r} is too short: an example needs "
                             "at least 2 tokens (a token, and the next one it predicts)")
        if assistant_turns not in ("all", "last"):
            raise ValueError(f"data.assistant_turns must be 'all' or 'last', got "
                             f"{assistant_turns!r}")
        self.options = {"chat_template": chat_template, "assistant_turns": assistant_turns,
                        "cpt_stride": cpt_stride,
                        "chat_template_kwargs": dict(chat_template_kwargs or {}),
                        "num_proc": num_proc}
        if mix_stopping not in ("first_exhausted", "all_exhausted"):
            raise ValueError(f"data.mix_stopping must be 'first_exhausted' (the mix ends with "
                             f"its first source used up) or 'all_exhausted' (smaller sources "
                             f"repeat until every one is used up), got {mix_stopping!r}")
        self.mix_stopping = mix_stopping
        if packing:
            check_packing_support()
        self.collate = PadCollator(tokenizer.pad_token_id, pad_to_multiple_of)
        self.train_set = self.val_set = self.train_examples = None

    def setup(self, stage: str | None = None):
        if self.train_set is None:
            # one example per row; what a teacher cache is keyed by, packed or not
            self.train_examples = build_dataset(self.train_sources, self.tokenizer,
                                                self.max_length, self.seed,
                                                stopping_strategy=self.mix_stopping,
                                                **self.options)
            self.train_set = self.train_examples
            if self.packing:  # validation stays one example per row
                self.train_set = pack_dataset(self.train_examples, self.max_length)
        if self.val_set is None and self.val_sources:
            self.val_set = build_dataset(self.val_sources, self.tokenizer, self.max_length,
                                         self.seed, mix=False, **self.options)

    def _loader(self, ds, batch_size, shuffle):
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=gen,
                          collate_fn=self.collate, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def train_dataloader(self):
        return self._loader(self.train_set, self.batch_size, self.shuffle)

    def val_dataloader(self):
        if self.val_set is None:
            return []
        return self._loader(self.val_set, self.val_batch_size, False)
