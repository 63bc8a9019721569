"""
Launches that crash, and launches of several machines. A rank that dies mid-run (SIGKILL: the OOM killer, a pre-empted
node) under `torchrun`: every other rank and the launcher end within 60 s, non-zero, and the launcher's report names
the rank that died; relaunching the same command with `resume_from_checkpoint=True` ends with the uninterrupted run's
parameters. Two "machines" of 2 processes each on loopback share one output folder: one complete checkpoint, which
resumes exactly in one process.

`tests/distributed/crash_worker.py` on CPU ranks (gloo): 2 ranks x 4 rows, a checkpoint every 2 steps, rank 1 killed
as step 5 begins (checkpoint-4 is complete). The reference is one process x 8 rows, uninterrupted.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from hf_parallel.saving.resume import checkpoint_problems
from hf_parallel.saving.staging import RUN_FILE, STAGING_DIR
from tests.distributed.crash_worker import run
from tests.helpers.paths import NO_GPUS, ROOT, repo_env
from tests.helpers.processes import free_port, run_together, run_until_failure

DEAD_RANK_LIMIT_S = 60
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")


def _torchrun(out, *flags: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [*launcher, "-m", "tests.distributed.crash_worker", str(out), "--per-device", "4", *flags]


def _env() -> dict[str, str]:
    env = repo_env(**NO_GPUS, OMP_NUM_THREADS="1")
    for name in LAUNCHER_VARIABLES:
        env.pop(name, None)
    return env


@pytest.mark.full  # 14 s: CI runs it in its own step (.ci/run), beside the default suite
def test_a_dead_rank_ends_the_job_and_a_relaunch_resumes_exactly(tmp_path):
    out = tmp_path / "run"
    kill = ["--kill-at-step", "4", "--kill-rank", "1"]
    mark = "crash_worker: rank 1 kills itself at step 4"
    died, after_s = run_until_failure(_torchrun(out, *kill), ROOT, _env(), mark, deadline_s=240)
    print(f"torchrun after rank 1 died: exit {died.returncode} in {after_s:.1f} s")
    assert after_s < DEAD_RANK_LIMIT_S, died.output[-3000:]
    # torchrun's failure report names the rank that died first, and the signal that ended it.
    root_cause = died.output[died.output.rfind("Root Cause") :]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause), died.output[-3000:]
    assert "Signal 9 (SIGKILL)" in root_cause, died.output[-3000:]
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()  # the last complete checkpoint

    run_together([_torchrun(out, "--resume")], ROOT, _env(), deadline_s=240)
    relaunched = torch.load(out / "final.pt", weights_only=True)
    reference = run(str(tmp_path / "uninterrupted"))
    assert max((relaunched[n] - reference[n]).abs().max().item() for n in reference) < 1e-6


@pytest.mark.full  # 15 s: CI runs it in its own step (.ci/run), beside the default suite
def test_two_machines_on_one_host_write_one_complete_checkpoint_that_resumes_exactly(tmp_path):
    out = tmp_path / "run"
    port = str(free_port())
    commands = [
        [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
            "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
            "-m", "tests.distributed.crash_worker", str(out), "--per-device", "2", "--max-steps", "4",
        ]
        for node in (0, 1)
    ]  # fmt: skip
    run_together(commands, ROOT, _env(), deadline_s=300)
    checkpoint = out / "checkpoint-4"
    # Every rank's random state, and one copy of everything else, renamed into place whole; nothing left staged.
    assert sorted(p.name for p in checkpoint.glob("rng_state*")) == [f"rng_state_{r}.pth" for r in range(4)]
    assert json.loads((checkpoint / RUN_FILE).read_text())["num_processes"] == 4
    assert checkpoint_problems(str(checkpoint)) == [] and not (out / STAGING_DIR).exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    # 4 ranks x 2 rows resumed as 1 process x 8 rows: the uninterrupted run's parameters.
    resumed = run(str(out), resume=True)
    reference = run(str(tmp_path / "uninterrupted"))
    assert max((resumed[n] - reference[n]).abs().max().item() for n in reference) < 1e-6
