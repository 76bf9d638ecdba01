"""Issue 18, case 7: the README's data example names its train and val sources alike
(`name: mine`); their examples shared ids, so the cache's example index mixed the splits and
training from the cache failed with "tokens of example 'mine:22' differs ... Rebuild it",
which rebuilding could not help. The val source's examples now have ids of their own."""

from __future__ import annotations

from distill.run.cache import cache_teacher_logits
from distill.train import train


def test_train_and_val_named_alike_cache_and_train(compose_cache, compose_train, tiny_assets,
                                                   tmp_path):
    named = [f"data.train=[{{name: mine, kind: sft, path: {tiny_assets['sft_train']}}}]",
             f"data.val=[{{name: mine, kind: sft, path: {tiny_assets['sft_val']}}}]"]
    cache = tmp_path / "cache"
    cache_teacher_logits(compose_cache(cache, "cache.top_k=8", *named))
    summary = train(compose_train(cache, "cache.top_k=8", "trainer.max_steps=3",
                                  "trainer.val_check_interval=3", *named, out=tmp_path / "out"))
    assert summary["global_step"] == 3 and summary["metrics"]["val/kl"] > 0
