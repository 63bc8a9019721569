"""
`benchmarks.gpu_check` on the GPU image it is made for, imitated on the CPU: no `datasets`, no `trl` (a dry run with
their imports blocked), and its version check; `benchmarks.gpu_wheels`' check of the wheels it carries there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
from packaging.requirements import Requirement

from benchmarks import gpu_check, gpu_wheels
from tests.helpers.paths import NO_GPUS, ROOT, repo_env

# Put first on PYTHONPATH, this hides installed packages as the GPU image lacks them: their import fails with
# ModuleNotFoundError, `importlib.util.find_spec` returns None and `importlib.metadata` finds no distribution.
HIDE_PACKAGES = """
import re
import sys
from importlib.machinery import PathFinder

HIDDEN = {"datasets", "trl"}


def _hidden(name):
    return re.sub(r"[-_.]+", "-", name or "").lower() in HIDDEN


class HidingPathFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if _hidden(name.partition(".")[0]) else PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return (d for d in PathFinder.find_distributions(*args, **kwargs) if not _hidden(d.metadata["Name"]))

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()


sys.meta_path[:] = [HidingPathFinder if finder is PathFinder else finder for finder in sys.meta_path]
"""


def _without_datasets_and_trl(tmp_path) -> dict[str, str]:
    hider = tmp_path / "hide_packages"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(textwrap.dedent(HIDE_PACKAGES))
    env = repo_env(**NO_GPUS)
    env["PYTHONPATH"] = os.pathsep.join([str(hider), env["PYTHONPATH"]])
    return env


def test_the_hidden_packages_look_uninstalled(tmp_path):
    probe = (
        "import importlib.metadata, importlib.util\n"
        "assert importlib.util.find_spec('datasets') is None and importlib.util.find_spec('trl') is None\n"
        "try:\n    import datasets\nexcept ModuleNotFoundError:\n    pass\nelse:\n    raise SystemExit('imported')\n"
        "names = {d.metadata['Name'].lower() for d in importlib.metadata.distributions()}\n"
        "assert 'datasets' not in names and 'trl' not in names and 'transformers' in names, names\n"
        "import transformers.utils\n"
        "assert not transformers.utils.is_datasets_available()\n"
    )
    env = _without_datasets_and_trl(tmp_path)
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.full  # 40 s: CI runs it in its own step (.ci/run), beside the default suite
def test_dry_run_without_datasets_and_trl_reaches_every_measurement(tmp_path):
    """The GPU run's whole flow on the CPU, in the image's place: every step passes and gets to what it measures."""
    out = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry_run", "--out", str(out)],
        cwd=ROOT, env=_without_datasets_and_trl(tmp_path), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    summary = json.loads(out.read_text()) if out.exists() else {}
    shown = f"exit {done.returncode}\n{done.stdout}\n{done.stderr}\n" + json.dumps(summary, indent=1)[-12000:]
    assert done.returncode == 0, shown
    versions = summary["versions"]
    assert versions["datasets"] is None and versions["trl"] is None, shown
    assert versions["transformers"] and versions["torch"] and versions["accelerate"], shown
    assert summary["version_error"] is None, shown
    steps = summary["steps"]
    assert {name: step["status"] for name, step in steps.items()} == dict.fromkeys(gpu_check.STEPS, "pass"), shown
    # tests: collected without error (pytest's exit 2), the module that needs TRL and datasets skipped.
    tests_tail = steps["tests"]["tail"]
    assert "ERROR collecting" not in tests_tail and "error" not in tests_tail.strip().splitlines()[-1], shown
    assert re.search(r"SKIPPED \[1\] tests/test_trl.py:\d+: could not import 'datasets'", tests_tail), shown
    assert "needs a CUDA GPU" in tests_tail, shown  # the gpu tests were selected, then skipped here
    # data_parallel: its FIGURES line, one configuration per case, precision and split, each within tolerance.
    runs = steps["data_parallel"]["figures"]["runs"]
    assert "llama_causal_lm bf16 gpu0_bsz=1" in runs and "gpt2_causal_lm fp32 even" in runs, shown
    assert all(run["ok"] for run in runs.values()), shown
    # balance: its table of configurations and its targets, not assessed in a dry run.
    assert "samples/s" in steps["balance"]["tail"] and "Targets:" in steps["balance"]["tail"], shown


def test_too_old_transformers_stops_before_any_step_naming_the_version_and_the_fix(monkeypatch, tmp_path, capsys):
    found = {**gpu_check.installed_versions(), "transformers": "5.17.0"}
    monkeypatch.setattr(gpu_check, "installed_versions", lambda: found)
    monkeypatch.setattr(gpu_check, "run_step", lambda *args: pytest.fail("a step ran"))
    out = tmp_path / "summary.json"
    assert gpu_check.main(["--dry_run", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "transformers 5.17.0 is installed; hf_parallel needs transformers<6,>=5.19" in error
    assert "python -m benchmarks.gpu_wheels" in error and "carry .whl" in error
    summary = json.loads(out.read_text())
    assert summary["versions"]["transformers"] == "5.17.0"
    assert summary["version_error"] == error.strip() and summary["steps"] == {}


def test_missing_accelerate_is_named_too():
    declared = gpu_check.declared_requirements()
    found = {"torch": "2.11.0+cu130", "transformers": "5.24.0", "accelerate": None}
    error = gpu_check.version_error(found, declared)
    assert error.startswith("gpu_check: accelerate is not installed; hf_parallel needs accelerate>=1.15"), error
    assert gpu_check.version_error({**found, "accelerate": "1.15.0"}, declared) is None


def test_wheel_requirements_leave_extras_out(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    metadata = "Name: demo\nRequires-Dist: dill<0.4.2,>=0.3.0\nRequires-Dist: pytest; extra == 'test'\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo-1.0.dist-info/METADATA", metadata)
    assert [str(r) for r in gpu_wheels.wheel_requirements(wheel)] == ["dill<0.4.2,>=0.3.0"]


def test_wheel_problems_name_what_neither_the_wheels_nor_the_image_provide():
    needs = ["dill<0.4.2", "huggingface-hub>=1.31.0,<3.0", "fsspec<=2026.9.0", "multiprocess<0.70.20"]
    wheels = {"datasets": ("5.2.0", [Requirement(r) for r in needs]), "dill": ("0.4.1", [])}
    image = {"huggingface-hub": "1.30.0", "fsspec": None}
    assert gpu_wheels.problems(wheels, image) == [
        "datasets 5.2.0 needs huggingface-hub<3.0,>=1.31.0; there: 1.30.0",
        "datasets 5.2.0 needs multiprocess<0.70.20: neither carried nor in the image; carry it too",
    ]
