"""
The wheels that `benchmarks.gpu_check` needs on a GPU machine without network, downloaded here into `.whl/`.

    python -m benchmarks.gpu_wheels                            # download into .whl/, check, print the device command
    python -m benchmarks.gpu_wheels --pin transformers==5.19.0 # another version of a carried package
    python -m benchmarks.gpu_wheels --check                    # check what .whl/ holds, download nothing

The image it is made for (Python 3.12, torch 2.11, CUDA 13) has transformers 5.17.0, below the 5.19 that hf_parallel
needs, and no `datasets` (an install requirement of hf_parallel). So `.whl/` gets, for CPython 3.12 on manylinux
x86_64, one version each: transformers and datasets at the versions installed here (where the test suite passes), and
what datasets needs that the image lacks (dill, multiprocess). Nothing else: accelerate 1.15, huggingface-hub 1.33,
tokenizers 0.23.2 and safetensors 0.8 there meet what these wheels require (the image's own transformers 5.17 asks the
same of regex, tqdm and packaging), and TRL only serves tests that skip without it. Each wheel's own requirements (its
METADATA's Requires-Dist) are checked against the other wheels and the image's packages; `gpu_check` checks them again
there against what is really installed.

On the GPU machine, with `.whl/` copied along (git ignores it, so it must be named: `carry: [".whl"]`), the command
starts with the install line printed at the end: pip installs the wheels without their dependencies into /tmp/site,
which `PYTHONPATH` puts before the image's own packages.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from benchmarks.gpu_check import declared_requirements

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
PYTHON = "3.12"
# pip matches a manylinux tag's glibc version exactly: list each one a pure or binary wheel may carry.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CARRIED = ("transformers", "datasets", "dill", "multiprocess")
# The image's packages that the carried wheels require: the version where it was read there, else None (present, the
# version unread; `gpu_check` reads it there and warns when it falls short).
IMAGE = {
    "torch": "2.11.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2",
    "safetensors": "0.8.0", "numpy": "2.5.2", "filelock": None, "fsspec": None, "packaging": None, "pandas": None,
    "pyarrow": None, "pyyaml": None, "regex": None, "requests": None, "tqdm": None, "typer": None, "xxhash": None,
    "httpx": None, "aiohttp": None, "peft": None,
}  # fmt: skip
INSTALL = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site || exit;"
)
RUN = "PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check --out $OUT/gpu_check.json"


def pins(overrides: list[str]) -> dict[str, str]:
    """The version of each carried package: the one installed here, or `--pin NAME==VERSION`."""
    chosen = {}
    for name in CARRIED:
        try:
            chosen[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            chosen[name] = None
    for pin in overrides:
        name, _, version = pin.partition("==")
        if canonicalize_name(name) not in CARRIED or not version:
            raise SystemExit(f"--pin {pin!r}: expected NAME==VERSION with NAME one of {', '.join(CARRIED)}.")
        chosen[canonicalize_name(name)] = version
    missing = [name for name, version in chosen.items() if version is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not installed here: install it or name its version with --pin.")
    return chosen


def download(chosen: dict[str, str], dest: Path = WHEELS) -> None:
    """Replace `dest`'s wheels with `chosen`'s (two versions of one package would stop the install there)."""
    dest.mkdir(exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    command = [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
        "--implementation", "cp", *platforms, "-d", str(dest), *(f"{n}=={v}" for n, v in chosen.items()),
    ]  # fmt: skip
    subprocess.run(command, check=True)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist, without its extras' (what `pip install NAME` would also install)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    requirements = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": "", "python_version": PYTHON})]


def problems(wheels: dict[str, tuple[str, list[Requirement]]], image: dict[str, str | None] = IMAGE) -> list[str]:
    """
    What the carried wheels require and neither they nor the image provide.

    Args:
        wheels (`dict[str, tuple[str, list[Requirement]]]`):
            Each carried package's canonical name: its version and its requirements.
        image (`dict[str, str | None]`, *optional*, defaults to `IMAGE`):
            The image's packages: their versions, `None` where unread (then any version is taken to do).
    """
    found = []
    available = {**image, **{name: version for name, (version, _) in wheels.items()}}
    for name, (version, requirements) in wheels.items():
        for requirement in requirements:
            have = canonicalize_name(requirement.name)
            if have not in available:
                found.append(f"{name} {version} needs {requirement}: neither carried nor in the image; carry it too")
            elif available[have] is not None and not requirement.specifier.contains(available[have], prereleases=True):
                found.append(f"{name} {version} needs {requirement}; there: {available[have]}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pin", action="append", default=[], help="NAME==VERSION for a carried package")
    parser.add_argument("--check", action="store_true", help="check the wheels in .whl/, download nothing")
    args = parser.parse_args(argv)
    if not args.check:
        download(pins(args.pin))
    wheels, sizes = {}, {}
    for wheel in sorted(WHEELS.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in wheels:
            raise SystemExit(f"{WHEELS}: two versions of {name}; keep one (pip stops on two).")
        wheels[name] = (str(version), wheel_requirements(wheel))
        sizes[wheel.name] = wheel.stat().st_size
        print(f"{wheel.name:<60} {sizes[wheel.name] / 2**20:6.1f} MiB")
    found = problems(wheels) + [f"{n}: no wheel in .whl/" for n in CARRIED if n not in wheels]
    declared = declared_requirements()
    for name, (version, _) in wheels.items():
        if name in declared and not declared[name].specifier.contains(version, prereleases=True):
            found.append(f"{name} {version}: hf_parallel needs {declared[name]} (setup.cfg); --pin another version")
    print(f"{'total':<60} {sum(sizes.values()) / 2**20:6.1f} MiB (the working tree that travels: 64 MiB at most)")
    for problem in found:
        print(f"problem: {problem}", file=sys.stderr)
    print(f'\nOn the GPU machine: carry [".whl"], command:\n  {INSTALL} {RUN}')
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
