"""Run several commands at once (launchers of one job), and fail with every process's output."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Below pytest's own timeout (600 s, pyproject.toml), so that a stuck launch fails with its output, not silently.
DEADLINE_S = 300


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a launcher's rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Finished:
    command: list[str]
    returncode: int | None  # None: killed at the deadline, or because another process failed first
    output: str


def _report(results: list[Finished], why: str) -> str:
    parts = [why]
    for index, result in enumerate(results):
        parts.append(f"---- process {index} (exit code {result.returncode}): {' '.join(result.command)}")
        parts.append(result.output[-6000:])
    return "\n".join(parts)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: the launcher and its workers
    for proc in procs:
        proc.wait()


def run_together(
    commands: list[list[str]], cwd: Path, env: dict[str, str], deadline_s: float = DEADLINE_S
) -> tuple[list[Finished], float]:
    """
    Start `commands` together and wait for all of them; return their results and the wall time.

    As soon as one exits non-zero, or at the deadline, the others are killed (each runs in its own session, so a
    launcher's workers go with it) and `AssertionError` is raised with every process's output. Output goes to
    files, not pipes, so that a process that prints a lot never blocks on a pipe nobody reads yet.
    """
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"{i}.log", "w+") for i in range(len(commands))]  # noqa: SIM115
        procs = [
            subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for cmd, log in zip(commands, logs, strict=True)
        ]
        why = None
        try:
            while why is None and any(proc.poll() is None for proc in procs):
                failed = [i for i, proc in enumerate(procs) if proc.poll() not in (None, 0)]
                if failed:
                    why = f"process {failed[0]} exited with {procs[failed[0]].returncode}; the others were stopped"
                elif time.perf_counter() - start > deadline_s:
                    why = f"still running after {deadline_s:g} s; stopped"
                else:
                    time.sleep(0.2)
            if why is None and any(proc.returncode != 0 for proc in procs):
                why = "a process exited with an error"
        finally:
            codes = [proc.poll() for proc in procs]
            _stop(procs)
        results = []
        for cmd, log, code in zip(commands, logs, codes, strict=True):
            log.seek(0)
            results.append(Finished(cmd, code, log.read()))
            log.close()
    if why is not None:
        raise AssertionError(_report(results, why))
    return results, time.perf_counter() - start


def run_until_failure(
    command: list[str], cwd: Path, env: dict[str, str], mark: str, deadline_s: float = DEADLINE_S
) -> tuple[Finished, float]:
    """
    Run `command`, which is expected to fail once `mark` appears in its output (a rank that kills itself says so
    first); return its result and the seconds from the mark's appearance to its exit. It must exit non-zero, after
    the mark, within `deadline_s`: anything else raises `AssertionError` with its output (it is killed at the deadline,
    with its whole session).
    """
    start = time.perf_counter()
    marked = None
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "out.log"
        with open(log_path, "w+") as log:
            proc = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                while proc.poll() is None and time.perf_counter() - start < deadline_s:
                    if marked is None and mark in log_path.read_text(errors="replace"):
                        marked = time.perf_counter()
                    time.sleep(0.2)
            finally:
                code = proc.poll()
                _stop([proc])
            ended = time.perf_counter()
            log.seek(0)
            result = Finished(command, code, log.read())
    if marked is None and mark in result.output:
        marked = ended  # it appeared in the last interval
    if code is None or code == 0 or marked is None:
        why = f"expected to exit non-zero after {mark!r} within {deadline_s:g} s"
        raise AssertionError(_report([result], why))
    return result, ended - marked
