"""`distill-export` from a checkout: python scripts/export_checkpoint.py <checkpoint> [...].

The command itself lives in distill/run/export.py (installed as `distill-export`).
"""

from distill.run.export import export, main  # noqa: F401  (tests import export from here)

if __name__ == "__main__":
    main()
