"""
The checks only a GPU can make, in one run of under 9 minutes, each step time-boxed, a summary file at the end.

    python -m benchmarks.gpu_check                      # on a machine with one or more CUDA GPUs
    python -m benchmarks.gpu_check --out gpu_check.json --budget 480
    python -m benchmarks.gpu_check --dry_run            # no GPU: the same flow on the CPU emulation (no figures)

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

The summary (`--out`, JSON) has, per step: status (`pass`, `fail`, `timeout`), seconds, and its output's tail; step 2
adds its figures (relative loss and parameter differences per configuration, the syncs found).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

STEPS = ("tests", "data_parallel", "balance")
# Seconds per step: with the start-up of each process, under 9 minutes in all.
TIME_BOXES = {"tests": 200, "data_parallel": 150, "balance": 150}


def command(step: str, dry_run: bool) -> list[str]:
    if step == "tests":
        markers = "gpu or multi_gpu"
        return [sys.executable, "-m", "pytest", "-q", "-m", markers, "tests", "-p", "no:cacheprovider"]
    if step == "data_parallel":
        return [sys.executable, "-m", "benchmarks.gpu_dp_check", *(["--dry_run"] if dry_run else [])]
    sizes = ["--vocab_size", "32000", "--seq_len", "256", "--num_layers", "4", "--steps", "3", "--warmup", "1"]
    return [sys.executable, "-m", "benchmarks.balance_gpu", *(["--dry_run", "2"] if dry_run else sizes)]


def run_step(step: str, dry_run: bool, box: float) -> dict:
    start = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command(step, dry_run), capture_output=True, text=True, timeout=box, env=env)
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
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; --dry_run runs the same flow on the CPU emulation.", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget
    summary = {"gpus": torch.cuda.device_count(), "torch": torch.__version__, "dry_run": args.dry_run, "steps": {}}
    for step in args.steps:
        box = min(TIME_BOXES[step], deadline - time.monotonic())
        if box < 10:
            summary["steps"][step] = {"status": "skipped", "seconds": 0, "tail": "no time left in --budget"}
            continue
        summary["steps"][step] = result = run_step(step, args.dry_run, box)
        print(f"{step:>14}: {result['status']} in {result['seconds']} s", flush=True)
        with open(args.out, "w") as f:  # written after every step: a run stopped from outside keeps what it had
            json.dump(summary, f, indent=2)
    print(f"summary: {args.out}")
    return 0 if all(r["status"] == "pass" for r in summary["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
