"""One table for a multirun: each job's swept values and final metrics, side by side.

`distill-train -m +experiment=sft_rkl loss.kind=forward_kl,reverse_kl` runs one job per
value, each in `multirun/<date>/<time>/<job>/`, and each job writes its last metrics to
`final_metrics.json` (callbacks.final_metrics). When the sweep ends, `SweepSummary` (a Hydra
callback, `hydra.callbacks` in conf/train.yaml) gathers them into `summary.csv` and
`summary.md` in the sweep's folder and prints the table. It reads files only, so it works
with any launcher (the jobs may have run in other processes or on other machines).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback

# the metrics a comparison of runs reads; val/* and accuracy/* are always kept
FIRST = ("train/loss", "rollout/teacher_logprob", "tokens/s")


def _wanted(key: str) -> bool:
    return key.startswith(("val/", "accuracy/")) or key in FIRST


def read_jobs(sweep_dir: Path) -> list[dict]:
    """[{job, overrides: [...], metrics: {...}}] of the jobs that finished, in job order."""
    jobs = []
    for path in sorted(sweep_dir.rglob("final_metrics.json")):
        folder = path.parent
        overrides = folder / ".hydra" / "overrides.yaml"
        jobs.append({"job": str(folder.relative_to(sweep_dir)),
                     "overrides": (yaml.safe_load(overrides.read_text()) or [])
                     if overrides.is_file() else [],
                     "metrics": json.loads(path.read_text())})
    return sorted(jobs, key=lambda j: (len(j["job"]), j["job"]))  # 2 before 10


def summary_rows(jobs: list[dict]) -> tuple[list[str], list[dict], list[str]]:
    """(columns, rows, the overrides every job shared): a row per job with the overrides
    that differ between jobs and the metrics worth comparing."""
    shared = [o for o in jobs[0]["overrides"] if all(o in j["overrides"] for j in jobs)]
    keys = sorted({k for j in jobs for k in j["metrics"] if _wanted(k)},
                  key=lambda k: (not k.startswith("accuracy/"), not k.startswith("val/"), k))
    rows = []
    for j in jobs:
        swept = {o.split("=", 1)[0]: o.split("=", 1)[-1] for o in j["overrides"]
                 if o not in shared}
        rows.append({"job": j["job"], **swept, "steps": j["metrics"].get("global_step"),
                     **{k: j["metrics"].get(k) for k in keys}})
    columns = list(dict.fromkeys(c for r in rows for c in r if c not in keys)) + keys
    return columns, rows, shared


def _cell(v) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_summary(sweep_dir: Path) -> str | None:
    """Write summary.csv and summary.md in the sweep folder; the markdown, or None when no
    job finished."""
    jobs = read_jobs(sweep_dir)
    if not jobs:
        return None
    columns, rows, shared = summary_rows(jobs)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"sweep {sweep_dir}: {len(rows)} jobs" + (f"; every job: {' '.join(shared)}"
                                                        if shared else ""), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(text)
    return text


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        text = write_summary(Path(config.hydra.sweep.dir))
        if text:
            print("\n" + text + f"(also in {config.hydra.sweep.dir}/summary.csv)")
