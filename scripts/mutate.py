"""Mutation testing: plant known one-line bugs in a copy of the repository, one at a time,
and check that the tests catch each of them.

    python scripts/mutate.py              # every mutation (`make mutate`), a table at the end
    python scripts/mutate.py --list       # the mutations and the tests each one runs
    python scripts/mutate.py --only t2    # those whose name contains "t2"

The repository (its tracked and untracked, not ignored files) is copied to a temporary
folder once. For each mutation, one exact text replacement (it must match exactly once in
its file, so a stale mutation fails loudly instead of testing nothing) is applied there, the
tests that should catch it run in that copy with a time limit, and the file is restored.
A mutation is caught when those tests fail. They are a subset of `make test`'s (which runs
every test), chosen for speed: a mutation caught here is caught by `make test`. First the
same tests run on the unmutated copy and must pass, or the results would mean nothing.
The exit status is 0 only if every mutation was caught. docs/testing.md has the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # file, relative to the repository
    old: str  # text that occurs exactly once in it
    new: str
    tests: tuple[str, ...]  # pytest arguments (files, node ids, -k expressions)
    what: str  # the bug, in words


PARITY_TORCH = ("tests/losses/test_parity_matrix.py", "-k", "torch")
FUSED = ("tests/losses/test_fused.py",)
STEP_WINDOWS = ("tests/data/test_step_windows.py",)

MUTATIONS = [
    # --- the two that the shared-spec reference let through (issue 25) -------------------
    Mutation("t2-as-t", "distill/ops/spec.py",
             "t2 = self.temperature**2 if self.temperature_squared else 1.0",
             "t2 = self.temperature if self.temperature_squared else 1.0",
             PARITY_TORCH, "temperature_squared multiplies by T, not T**2"),
    Mutation("divergence-weight-ignored", "distill/ops/spec.py",
             "return t2 * self.divergence_weight", "return t2",
             PARITY_TORCH, "divergence_weight is never applied"),
    # --- ten that the suite caught before ---------------------------------------------------
    Mutation("valid-tokens-local", "distill/training/normalization.py",
             "return valid / max(step.valid, 1)",
             "return valid / max(int(masks.valid.sum()), 1)",
             ("tests/test_normalization.py", "tests/test_normalization_positions.py"),
             "valid_tokens divides by the micro-batch's count, not the step's"),
    Mutation("all-tokens-by-valid", "distill/training/normalization.py",
             "return valid / max(step.real, 1)", "return valid / max(step.valid, 1)",
             ("tests/test_normalization.py", "tests/test_normalization_positions.py"),
             "all_tokens divides by the valid tokens"),
    Mutation("window-counts-first-only", "distill/data/windows.py",
             "return sum((count_tensor(b, ignore_index) for b in batches),",
             "return sum((count_tensor(b, ignore_index) for b in batches[:1]),",
             STEP_WINDOWS,
             "a window's counts are its first micro-batch's"),
    Mutation("counts-not-all-reduced", "distill/data/windows.py",
             'total = strategy.reduce(local.to(strategy.root_device), reduce_op="sum")',
             "total = local.to(strategy.root_device) * trainer.world_size",
             STEP_WINDOWS,
             "the step's counts are this rank's times W, not summed over the ranks"),
    Mutation("resume-position", "distill/data/windows.py",
             "self._trained = (info.epoch, info.position + 1)",
             "self._trained = (info.epoch, info.position)",
             STEP_WINDOWS,
             "a checkpoint records the micro-batch in training as not yet trained"),
    Mutation("cache-hash-unchecked", "distill/cache/reader.py",
             "if example_hash(input_ids, labels) != th:", "if False:",
             ("tests/cache/test_mismatch.py",),
             "an example whose tokens changed is served its old targets"),
    Mutation("chat-end-of-turn", "distill/data/chat.py",
             "end = k  # the blank tail after the end-of-turn token is never generated",
             "end = k - 1  # the blank tail after the end-of-turn token is never generated",
             ("tests/data/test_templates.py",),
             "the end-of-turn token is left out of the trained span"),
    Mutation("sparse-tail-unmasked", "distill/ops/divergence_torch.py",
             "logq_tail = _logsumexp(off_topk)", "logq_tail = _logsumexp(logq)",
             (*FUSED, "-k", "cached"),
             "the student's tail bucket holds its whole mass, the cached ids' too"),
    Mutation("reverse-kl-floor", "distill/ops/divergence_torch.py",
             "p_tail = p_tail.clamp_min(TAIL_FLOOR)", "p_tail = p_tail.clamp_min(TAIL_FLOOR**2)",
             PARITY_TORCH, "reverse KL floors the teacher's tail at 1e-16, not 1e-8"),
    Mutation("cached-retempered", "distill/ops/divergence_torch.py",
             "logp_k = logp_k.float()", "logp_k = logp_k.float() / spec.temperature",
             (*FUSED, "-k", "cached"),
             "cached log-probs (already at T) are divided by T again"),
    Mutation("ce-on-tempered", "distill/ops/divergence_torch.py",
             "logp_hard = logq if t == 1.0 else _log_softmax(zs)", "logp_hard = logq",
             (*FUSED, "-k", "live"), "the CE is taken of the tempered logits"),
    Mutation("ignore-index-default", "distill/losses/fused.py",
             "weights=weights, spec=spec, ce_rows=ce_rows, ignore_index=ignore_index,",
             "weights=weights, spec=spec, ce_rows=ce_rows, ignore_index=IGNORE_INDEX,",
             PARITY_TORCH, "a custom ignore_index is replaced by -100 in the op"),
    # --- new: the loss kinds, the cache reader, chat masks, resume, the sampler -----------
    Mutation("jsd-beta-swapped", "distill/ops/divergence_torch.py",
             "b = spec.beta", "b = 1 - spec.beta",
             (*FUSED, "-k", "jsd"), "jsd uses 1 - beta"),
    Mutation("reverse-is-forward", "distill/ops/divergence_torch.py",
             "return _plogratio(q, logq, logp).sum(-1), torch.where(q > 0, logq - logp, 0.0)",
             "return _plogratio(p, logp, logq).sum(-1), torch.where(q > 0, logq - logp, 0.0)",
             (*FUSED, "-k", "reverse"), "reverse_kl computes the forward KL"),
    Mutation("cache-row-offset", "distill/cache/reader.py",
             "rows = torch.from_numpy(pos.astype(np.int64)) + (i * (t - 1) + start)",
             "rows = torch.from_numpy(pos.astype(np.int64)) + (i * t + start)",
             ("tests/cache/test_mismatch.py",),
             "a row's targets are placed at a row width of T, not T - 1"),
    Mutation("chat-prompt-trained", "distill/data/chat.py",
             "return len(p), end", "return len(p) - 1, end",
             ("tests/data/test_templates.py",),
             "the generation prompt's last token is trained"),
    Mutation("resume-window-skip", "distill/data/windows.py",
             "self.sampler.epoch, self.sampler.start = epoch, (position // k) * k",
             "self.sampler.epoch, self.sampler.start = epoch, position // k",
             STEP_WINDOWS,
             "a resumed epoch skips windows, not micro-batches"),
    Mutation("sampler-seed-unused", "distill/onpolicy/samplers.py",
             "torch.manual_seed(seed)", "torch.manual_seed(0)",
             ("tests/test_onpolicy.py", "-k", "sampler"), "every rollout samples with seed 0"),
    Mutation("sampler-top-p-ignored", "distill/onpolicy/samplers.py",
             "top_p=None if greedy else s.top_p, top_k=0,", "top_p=None, top_k=0,",
             ("tests/test_onpolicy.py", "-k", "sampler"), "top_p is never passed to generate"),
    Mutation("sampler-eos-not-stopping", "distill/onpolicy/samplers.py",
             "return tokens[: i + 1]", "return tokens",
             ("tests/test_onpolicy.py", "-k", "sample"),
             "a completion keeps what follows its eos"),
]


def copy_repo(dst: Path) -> None:
    """The repository's tracked and untracked (not ignored) files, without .git."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src, out = ROOT / rel, dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # e.g. conf -> distill/conf: a link again, relative as it was
            os.symlink(os.readlink(src), out)
        elif src.is_file():
            shutil.copy2(src, out)


def run_tests(root: Path, args: tuple[str, ...], timeout: int) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout', seconds, the first failing test) of pytest on
    `args` in `root`."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    seconds = time.perf_counter() - t0
    if proc.returncode == 5:  # no test collected: the selection is stale
        raise SystemExit(f"no test selected by {' '.join(args)}:\n{proc.stdout[-2000:]}")
    failing = next((line.split(" ", 1)[1].split(" - ")[0] for line in proc.stdout.splitlines()
                    if line.startswith(("FAILED ", "ERROR "))), "")  # -ra's summary lines
    return ("passed" if proc.returncode == 0 else "failed"), seconds, failing


def apply(root: Path, m: Mutation) -> str:
    """Plant `m` in the copy; returns the file's original text."""
    path = root / m.path
    text = path.read_text()
    found = text.count(m.old)
    if found != 1:
        raise SystemExit(f"mutation {m.name}: {m.old!r} occurs {found} times in {m.path} "
                         "(must be exactly once): update the mutation list")
    path.write_text(text.replace(m.old, m.new))
    return text


def table(results: list[tuple[Mutation, str, float, str]]) -> str:
    lines = ["| mutation | file | the bug | tests run | first failing test | result | s |",
             "|---|---|---|---|---|---|---|"]
    for m, result, seconds, failing in results:
        tests = " ".join(m.tests)
        lines.append(f"| `{m.name}` | `{m.path}` | {m.what} | `{tests}` | "
                     f"`{failing.split('/')[-1] or '-'}` | {result} | {seconds:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", default=None, help="mutations whose name contains this")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test run")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the run of the tests on the unmutated copy")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only is None or args.only in m.name]
    if args.list or not chosen:
        for m in chosen:
            print(f"{m.name:28s} {m.path:34s} {' '.join(m.tests)}")
        return 0 if chosen else 1
    with tempfile.TemporaryDirectory(prefix="distill-mutate-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        for m in chosen:  # every mutation still applies (fail fast, before any test runs)
            (root / m.path).write_text(apply(root, m))
        if not args.no_baseline:
            selections = list(dict.fromkeys(m.tests for m in chosen))
            for sel in selections:
                result, seconds, _ = run_tests(root, sel, args.timeout)
                print(f"baseline {' '.join(sel)}: {result} ({seconds:.0f} s)", flush=True)
                if result != "passed":
                    raise SystemExit("the unmutated tests do not pass: fix them first")
        results = []
        for m in chosen:
            original = apply(root, m)
            try:
                result, seconds, failing = run_tests(root, m.tests, args.timeout)
            finally:
                (root / m.path).write_text(original)
            verdict = {"failed": "caught", "passed": "MISSED", "timeout": "timeout"}[result]
            results.append((m, verdict, seconds, failing))
            print(f"{verdict:7s} {m.name:28s} {seconds:5.0f} s  {failing}", flush=True)
    print()
    print(table(results))
    missed = [m.name for m, verdict, _, _ in results if verdict != "caught"]
    print(f"\n{len(results) - len(missed)} of {len(results)} caught"
          + (f"; not caught: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
