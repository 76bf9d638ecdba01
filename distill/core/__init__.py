"""The ground every part of distill stands on: the vocabulary of settings (`rules`), shared
constants, and checkpoint files written atomically (`checkpoint_io`). Imports nothing
else of distill."""
