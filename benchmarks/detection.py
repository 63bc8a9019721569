"""
DETR-style detection, stock against hf_parallel: the tiny DETR, Deformable DETR and YOLOS of
`tests/helpers/detection.py`, one SGD step over 8 images (0 to 4 boxes each) and an evaluation of 7, under gradient
accumulation 2 (in process) and 2-rank DDP (spawned CPU ranks), each side against one process on the same images.
Printed per model and topology: the logged loss, the eval loss (as ratios to one process's) and how far the gradient is
off (relative to its largest entry), for stock `transformers.Trainer` and for `hf_parallel.Trainer`, measured in the
same run.

    python -m benchmarks.detection 2>/dev/null          # GA 2 and DDP 2 (about a minute on 2 cores)
    python -m benchmarks.detection --no-ddp 2>/dev/null  # GA 2 only
"""

from __future__ import annotations

import argparse
import tempfile

from tests.helpers.detection import CASES
from tests.helpers.harness import DDP2, GA2, SINGLE, max_relative_diff, run_case, run_ddp_runs

__all__ = ["main", "measure"]


def measure(ddp: bool = True) -> list[tuple[str, str, str, float, float, float]]:
    """Rows of (model, topology, side, loss ratio, eval loss ratio, gradient off) against one process."""
    ddp_results = {}
    if ddp:
        runs = {(name, side): (CASES[name], DDP2, side == "stock", {}) for name in CASES for side in ("stock", "ours")}
        with tempfile.TemporaryDirectory() as tmp:
            by_name = run_ddp_runs({f"{n}|{s}": run for (n, s), run in runs.items()}, tmp)
        ddp_results = {tuple(key.split("|")): result for key, result in by_name.items()}
    rows = []
    for name in CASES:
        single = run_case(CASES[name], SINGLE)
        for side in ("stock", "ours"):
            results = [("GA 2", run_case(CASES[name], GA2, stock=side == "stock"))]
            if ddp:
                results.append(("DDP 2", ddp_results[name, side]))
            for topology, result in results:
                rows.append(
                    (
                        name,
                        topology,
                        "stock" if side == "stock" else "hf_parallel",
                        result.loss / single.loss,
                        result.eval_loss / single.eval_loss,
                        max_relative_diff(result.grads, single.grads),
                    )
                )
    return rows


def print_table(rows) -> None:
    print("| model | topology | trainer | loss / one process | eval_loss / one process | gradient off |")
    print("|---|---|---|---|---|---|")
    for name, topology, side, loss, eval_loss, grad in rows:
        print(f"| {name} | {topology} | {side} | x{loss:.4f} | x{eval_loss:.4f} | {grad:.1e} |")


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-ddp", action="store_true", help="gradient accumulation only (no spawned ranks)")
    args = parser.parse_args(argv)
    rows = measure(ddp=not args.no_ddp)
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
