"""`python -m distill.train +experiment=sft_rkl [overrides]` (or `distill-train`): the
training command. The run is built in `distill.run.train`; `train(cfg)` runs it in-process."""

from distill.run.train import main, train

__all__ = ["main", "train"]

if __name__ == "__main__":
    main()
