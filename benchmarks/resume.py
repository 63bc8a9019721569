"""
Sharded runs that survive, measured: each resume of `tests/engines/test_deepspeed_resume.py` (DeepSpeed ZeRO on 2 CPU
ranks: a kill mid-save, 2 ranks -> 1 process, 1 -> 2) and `tests/saving/test_sharded_resume.py` (a model sharded at
load time, `DistributedConfig(fsdp_size=2)`: the same layout, a kill mid-save, tensor parallelism, one plain process,
a plain process's checkpoint onto the sharded layout), stock's outcome beside hf_parallel's, in one run.

    python -m benchmarks.resume 2>/dev/null   # about 3 minutes on 2 cores; needs deepspeed for its first half

Every run trains 6 SGD steps with momentum 0.9 (a lost optimizer state shows) of a global batch of 8 with a checkpoint
every 2 steps; each resumed run is compared with the uninterrupted run of the same engine: the largest parameter
difference, and the distance of the parameters from it as a fraction of the uninterrupted run's whole update. Where
stock cannot resume, its error is printed instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from tests.helpers.resumes import largest_difference  # noqa: E402


def _off(params: dict, reference: dict, initial: dict) -> str:
    largest = largest_difference(params, reference)
    distance = sum(((params[n] - reference[n]) ** 2).sum() for n in reference) ** 0.5
    update = sum(((reference[n] - initial[n].float()) ** 2).sum() for n in reference) ** 0.5
    return f"largest difference {largest:.1e}, {100 * float(distance / update):.2g} % of the update"


def _error(message: str, root: str, key: str | None = None) -> str:
    """An error's first line (its folders shortened), and `key` where the message holds it further down."""
    line = message.splitlines()[0].replace(root, "...")
    line = line if len(line) <= 150 else line[:150] + " ..."
    return f"{line} ... {key}" if key is not None and key in message and key not in line else line


def _deepspeed(root: str) -> list[tuple[str, str, str]]:
    from tests.engines.test_deepspeed_resume import KILLED_STAGES, STAGES, run_all
    from tests.helpers.heads import CASES

    runs = run_all(root)
    initial = dict(CASES["bert_single_label"].build(0).named_parameters())
    rows = []
    for stage in KILLED_STAGES:
        reference = runs["uninterrupted"][stage]
        ours = _off(runs["two"][stage], reference, initial)
        rows.append(
            (
                f"ZeRO-{stage}, SIGKILL inside the save of checkpoint-4",
                _error(runs["two"][f"{stage} stock"], root),
                ours,
            )
        )
    for stage in STAGES:
        reference = runs["uninterrupted"][stage]
        stock = _error(runs["one"][f"{stage} stock"], root)
        rows.append(
            (
                f"ZeRO-{stage}, 2 ranks x 4 rows -> 1 process x 4 rows x GA 2",
                stock,
                _off(runs["one"][stage], reference, initial),
            )
        )
    rows.append(
        (
            "ZeRO-3, 1 process x 4 rows x GA 2 -> 2 ranks x 4 rows",
            "(the same exception)",
            _off(runs["two"]["1 to 2"], runs["uninterrupted"][3], initial),
        )
    )
    rows.append(
        (
            "a plain checkpoint resumed under DeepSpeed",
            "fails once the engine has started",
            _error(runs["one"]["plain under DeepSpeed"], root),
        )
    )
    rows.append(
        (
            "a DeepSpeed checkpoint resumed without it",
            "not measured",
            _error(runs["one"]["DeepSpeed without it"], root),
        )
    )
    return rows


def _sharded(root: str) -> list[tuple[str, str, str]]:
    from tests.saving.test_sharded_resume import run_all

    runs = run_all(root)
    initial = dict(transformers.LlamaForTokenClassification.from_pretrained(f"{root}/initial").named_parameters())
    reference = runs["uninterrupted"]
    layout = "`DistributedConfig(fsdp_size=2)`"
    return [
        (f"{layout}, save with its optimizer state", _error(runs["stock with optimizer state"], root), "checkpointed"),
        (
            "resumed on the same 2 ranks",
            _error(runs["stock model only"], root, "got mixed torch.Tensor and DTensor"),
            _off(runs["fsdp"], reference, initial),
        ),
        ("SIGKILL inside the save of checkpoint-4", "(cannot resume)", _off(runs["killed"], reference, initial)),
        (
            "checkpoint-2 resumed as `tp_size=2`, 4 rows x GA 2",
            "(cannot resume)",
            _off(runs["tp"], reference, initial),
        ),
        (
            "checkpoint-2 resumed by one plain process, 4 rows x GA 2",
            "model-only: " + _off(runs["stock one process"], reference, initial),
            _off(runs["one process"], reference, initial),
        ),
        (
            "a plain process's checkpoint-2 resumed as `fsdp_size=2`",
            "not measured",
            _off(runs["1 to 2"], reference, initial),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print("| case | stock | hf_parallel |\n|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        if importlib.util.find_spec("deepspeed") is not None:
            rows += _deepspeed(os.path.join(root, "deepspeed"))
        else:
            print('(deepspeed is not installed: its rows are left out; pip install -e ".[deepspeed]")')
        rows += _sharded(os.path.join(root, "sharded"))
    for case, stock, ours in rows:
        print(f"| {case} | {stock} | {ours} |")


if __name__ == "__main__":
    main()
