"""A run, from a config to a trained and exported student: the schema of every setting
(`config`), the three commands (`train`, `cache`, `export`), the Python API (`api`), and
what assembles a run (callbacks, loggers, trainer, resume, output paths, summaries)."""
