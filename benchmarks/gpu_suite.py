"""
The default test suite on a machine with many cores (a lent GPU machine), in shards run side by side, with one summary:
every failing or erroring test by name with its first error line, the counts, and how long the suite would take run
as one `pytest -q` (the sum of the tests' own times, the wall time of the shards aside).

    python -m benchmarks.gpu_suite                  # 4 shards of the default suite, stopped after 420 s
    python -m benchmarks.gpu_suite --shards 2 --box 60 tests/data_parallel/test_chunking.py tests/commands/test_cli.py

Test files are dealt to the shards largest first, each to the shard with the least so far; each shard is one pytest
process with its own junit report (`-p no:cacheprovider`, so that shards do not write the same cache). The last line
is `FIGURES {json}` (what `benchmarks.gpu_check` keeps of a step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_files(paths: list[str]) -> list[Path]:
    """The test modules under `paths` (files or folders), relative to the checkout."""
    found = []
    for path in map(Path, paths or ["tests"]):
        path = path if path.is_absolute() else ROOT / path
        found.extend(sorted(path.rglob("test_*.py")) if path.is_dir() else [path])
    return found


def deal(files: list[Path], shards: int) -> list[list[Path]]:
    """`files` in `shards` groups of about equal size (bytes of source, a stand-in for time), largest first."""
    groups: list[list[Path]] = [[] for _ in range(max(1, min(shards, len(files))))]
    sizes = [0] * len(groups)
    for file in sorted(files, key=lambda f: f.stat().st_size, reverse=True):
        i = sizes.index(min(sizes))
        groups[i].append(file)
        sizes[i] += file.stat().st_size
    return groups


def summarise(reports: list[Path]) -> dict:
    """Counts, failures (test id and its first error line), summed test time and the slowest tests of junit reports."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, times = [], []
    for report in reports:
        if not report.exists():
            continue
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            times.append((float(case.get("time") or 0), name))
            problem = next((case.find(tag) for tag in ("failure", "error") if case.find(tag) is not None), None)
            if case.find("skipped") is not None:
                counts["skipped"] += 1
            elif problem is not None:
                counts["failed" if problem.tag == "failure" else "errors"] += 1
                text = (problem.get("message") or problem.text or "").strip().splitlines()
                failures.append(f"{name}: {text[0][:300] if text else problem.tag}")
                details = (problem.text or "").strip().splitlines()
                if len(details) > 1:
                    # Where it failed and what a child process printed last (an example's own traceback).
                    failures.append("    ... " + " | ".join(line.strip()[:200] for line in details[-8:]))
            else:
                counts["passed"] += 1
    times.sort(reverse=True)
    return {
        **counts,
        "failures": failures,
        "test_seconds": round(sum(t for t, _ in times), 1),
        "slowest": [f"{t:.1f} s {name}" for t, name in times[:15]],
    }


def run(paths: list[str], shards: int, box: float) -> dict:
    groups = deal(test_files(paths), shards)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        reports = [Path(tmp) / f"shard{i}.xml" for i in range(len(groups))]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
        logs = [open(Path(tmp) / f"shard{i}.log", "w+") for i in range(len(groups))]  # noqa: SIM115
        processes = [
            subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", f"--junitxml={report}"]
                + [str(f) for f in group],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for group, report, log in zip(groups, reports, logs, strict=True)
        ]
        stopped = []
        for i, process in enumerate(processes):
            try:
                process.wait(timeout=max(1.0, box - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                stopped.append(i)
        summary = summarise(reports)
        tails = []
        for i, log in enumerate(logs):
            log.seek(0)
            lines = log.read().splitlines()
            log.close()
            if i in stopped or processes[i].returncode not in (0, 1, 5):
                tails.append(f"shard {i} (exit {processes[i].returncode}): " + " | ".join(lines[-5:]))
    summary.update(
        shards=len(groups),
        wall_seconds=round(time.monotonic() - start, 1),
        stopped_shards=[[str(f.relative_to(ROOT)) for f in groups[i]] for i in stopped],
        shard_tails=tails,
    )
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test files or folders (default: tests)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--box", type=float, default=420.0, help="seconds before the shards still running are stopped")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    summary = run(args.paths, args.shards, args.box)
    for line in summary["failures"]:
        print(f"FAILED {line}")
    print(
        f"suite: {summary['passed']} passed, {summary['failed']} failed, {summary['errors']} errors, "
        f"{summary['skipped']} skipped; tests' own time {summary['test_seconds']} s, wall {summary['wall_seconds']} s "
        f"in {summary['shards']} shards"
    )
    print("FIGURES " + json.dumps(summary))
    ok = not summary["failures"] and not summary["stopped_shards"] and not summary["shard_tails"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
