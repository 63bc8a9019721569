"""
The checks only a GPU can make, in one run of under 9 minutes, each step time-boxed, a summary file at the end.

    python -m benchmarks.gpu_check                      # on a machine with one or more CUDA GPUs
    python -m benchmarks.gpu_check --out gpu_check.json --budget 480
    python -m benchmarks.gpu_check --dry_run            # no GPU: the same flow on the CPU emulation (no figures)

First the versions: torch, transformers and accelerate must be in the ranges setup.cfg declares, or the run stops at
once (transformers below 5.19 lacks `Trainer.loss_is_scaled_for_ga`: every exact step would raise), naming the fix. A
machine that cannot download gets newer packages as wheels made here (`python -m benchmarks.gpu_wheels`, README: "The
GPU check on a machine without network").

Steps (each in its own process, stopped at its time box; a step that fails or times out does not stop the others):
1. `tests`: the test suite's `gpu` and `multi_gpu` tests (torch's real DataParallel over `device_ids=[0, 0]`, FSDP,
   DeepSpeed, CUDA-side launch guards).
2. `data_parallel`: `hf_parallel.Trainer` through real `nn.DataParallel` replicas over `device_ids=[0, 0]` (or
   `[0, 1]` with two GPUs), one SGD step, against one device on the same rows: fp32 and bf16, the even split
   (`ExactDataParallel`) and `gpu0_bsz` 0 and 1 (`BalancedDataParallel`), a tied model (GPT-2) and an untied one
   (Llama). Then a host-sync check: after the first step, hf_parallel's own code makes no synchronising CUDA call
   (`torch.cuda.set_sync_debug_mode("warn")`, warnings raised from files of the package).
3. `balance`: `benchmarks.balance_gpu` at small sizes (vocabulary 32000, sequence 256, 4 layers): GPU 0's peak memory
   and samples/s, hf_parallel against stock in the same run.
4. `suite`: the default test suite in shards side by side (`benchmarks.gpu_suite`): every failing test by name with its
   first error line, the counts, the tests' summed time (what one `pytest -q` would take) and the slowest tests.

The summary (`--out`, JSON) has the versions found (`versions`; `version_warnings`: each requirement of transformers,
accelerate or datasets that the installed packages do not meet; `version_error` when the run stopped there) and, per
step: status (`pass`, `fail`, `timeout`), seconds, and its output's tail; step 2 adds its figures (relative loss and
parameter differences per configuration, the syncs found).
"""

from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from packaging.requirements import Requirement

STEPS = ("tests", "data_parallel", "balance", "suite")
# Seconds per step: with the start-up of each process, under 9 minutes for the first three; the suite's shards take
# what is left of --budget.
TIME_BOXES = {"tests": 200, "data_parallel": 150, "balance": 150, "suite": 420}
# The dry run's suite: two small modules, enough to run the shards and their summary.
DRY_SUITE = ["tests/data_parallel/test_chunking.py", "tests/test_training_args.py"]
SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"
# What every step imports: missing or outside setup.cfg's range, the run stops before the first step.
NEEDED = ("torch", "transformers", "accelerate")
# Reported only: a test that needs one skips without it (no GPU step does).
OPTIONAL = ("datasets", "peft", "trl")
# Whose own requirements (their wheels' Requires-Dist) are checked against what is installed: the carried wheels are
# installed without their dependencies (`--no-deps`), so nothing else would notice a dependency that is too old.
DEPENDENCIES_CHECKED = ("transformers", "accelerate", "datasets")
WHEELS_FIX = (
    "Fix: on a machine with network, in the repository's root, run `python -m benchmarks.gpu_wheels` (it downloads "
    "newer wheels into .whl/); then carry .whl to the GPU machine and start its command with the install line that "
    'command prints (README: "The GPU check on a machine without network").'
)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_versions(names=NEEDED + OPTIONAL) -> dict[str, str | None]:
    """The installed version of each package in `names`, `None` for one that is not installed (nothing imported)."""
    return {name: _version(name) for name in names}


def declared_requirements(setup_cfg: Path = SETUP_CFG) -> dict[str, Requirement]:
    """hf_parallel's `install_requires` (setup.cfg), by package name: the one place its version ranges are kept."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    lines = (line.strip() for line in parser["options"]["install_requires"].splitlines())
    return {req.name: req for req in map(Requirement, filter(None, lines))}


def version_error(found: dict[str, str | None], declared: dict[str, Requirement]) -> str | None:
    """Why the steps cannot run with the versions `found` (a message naming each version, the range and the fix)."""
    problems = []
    for name in NEEDED:
        requirement, version = declared[name], found.get(name)
        if version is None:
            problems.append(f"{name} is not installed; hf_parallel needs {requirement}")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{name} {version} is installed; hf_parallel needs {requirement}")
    if not problems:
        return None
    return "gpu_check: " + "; ".join(problems) + " (setup.cfg install_requires). " + WHEELS_FIX


def dependency_warnings(packages=DEPENDENCIES_CHECKED) -> list[str]:
    """Each requirement of an installed package in `packages` that the installed versions do not meet."""
    warnings = []
    for name in filter(_version, packages):
        for requirement in map(Requirement, importlib.metadata.requires(name) or []):
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue  # an extra's requirement, or one for another platform
            found = _version(requirement.name)
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                warnings.append(f"{name} {_version(name)} needs {requirement}; installed: {found or 'none'}")
    return warnings


def command(step: str, dry_run: bool, box: float = 0.0) -> list[str]:
    if step == "tests":
        # A module that cannot be imported (a missing package imported at module level) is reported and the step
        # fails, but the GPU tests of every other module still run: a lent GPU machine's minutes are few.
        options = ["-q", "-m", "gpu or multi_gpu", "--continue-on-collection-errors", "-p", "no:cacheprovider"]
        return [sys.executable, "-m", "pytest", *options, "tests"]
    if step == "data_parallel":
        return [sys.executable, "-m", "benchmarks.gpu_dp_check", *(["--dry_run"] if dry_run else [])]
    if step == "suite":
        paths = DRY_SUITE if dry_run else []
        # The shards stop 20 s before the step's box, so that their summary is still written.
        return [sys.executable, "-m", "benchmarks.gpu_suite", "--box", str(max(10.0, box - 20)), *paths]
    sizes = ["--vocab_size", "32000", "--seq_len", "256", "--num_layers", "4", "--steps", "3", "--warmup", "1"]
    return [sys.executable, "-m", "benchmarks.balance_gpu", *(["--dry_run", "2"] if dry_run else sizes)]


def run_step(step: str, dry_run: bool, box: float) -> dict:
    start = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command(step, dry_run, box), capture_output=True, text=True, timeout=box, env=env)
        status, output = ("pass" if done.returncode == 0 else "fail"), done.stdout + done.stderr
        if step == "tests" and done.returncode == 5:
            status = "pass"  # no test collected: no GPU test applies (dry run)
    except subprocess.TimeoutExpired as stopped:
        status = "timeout"
        output = (stopped.stdout or b"").decode(errors="replace") + (stopped.stderr or b"").decode(errors="replace")
    result = {"status": status, "seconds": round(time.monotonic() - start, 1), "tail": output[-4000:]}
    figures = [line for line in output.splitlines() if line.startswith("FIGURES ")]
    if figures:
        result["figures"] = json.loads(figures[-1].removeprefix("FIGURES "))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the summary file")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--budget", type=float, default=500.0, help="seconds for all steps (time boxes shrink to fit)")
    parser.add_argument("--dry_run", action="store_true", help="no GPU: the CPU emulation, no figures")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget
    found = installed_versions()
    summary = {"dry_run": args.dry_run, "versions": found, "version_warnings": dependency_warnings(), "steps": {}}
    print("versions: " + ", ".join(f"{name} {version or 'none'}" for name, version in found.items()), flush=True)
    for warning in summary["version_warnings"]:
        print(f"  warning: {warning}", flush=True)
    summary["version_error"] = error = version_error(found, declared_requirements())
    if error is not None:
        print(error, file=sys.stderr)
        _write(summary, args.out)
        return 2
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; --dry_run runs the same flow on the CPU emulation.", file=sys.stderr)
        return 2
    summary.update(gpus=torch.cuda.device_count(), torch=torch.__version__)
    for step in args.steps:
        box = min(TIME_BOXES[step], deadline - time.monotonic())
        if box < 10:
            summary["steps"][step] = {"status": "skipped", "seconds": 0, "tail": "no time left in --budget"}
            continue
        summary["steps"][step] = result = run_step(step, args.dry_run, box)
        print(f"{step:>14}: {result['status']} in {result['seconds']} s", flush=True)
        _write(summary, args.out)  # after every step: a run stopped from outside keeps what it had
    print(f"summary: {args.out}")
    return 0 if all(r["status"] == "pass" for r in summary["steps"].values()) else 1


def _write(summary: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
