"""
Which of hf_parallel's files and functions one optimizer step enters, traced with `sys.setprofile` (comprehensions
aside): the Trainer's step 3 of a run whose first step is behind it (48 rows, so mid-epoch), or its first step, for the
runs of `RUNS`; on 2 DDP ranks, rank 0's. `hf_parallel/testing/` is left out: it stands in for torch's C++ copies
between GPUs on a machine without them, and a GPU machine never enters it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

import hf_parallel

PACKAGE = Path(hf_parallel.__file__).parent
ROWS, PER_DEVICE, ACCUMULATION = 48, 2, 2


class Tracer:
    """Every hf_parallel function entered between `start()` and `stop()`, as `(path, name)` in order."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def _profile(self, frame, event, arg):
        code = frame.f_code
        if event != "call" or code.co_name.startswith("<") or not code.co_filename.startswith(str(PACKAGE)):
            return
        path = Path(code.co_filename).relative_to(PACKAGE).as_posix()
        if not path.startswith("testing/"):
            self.calls.append((path, code.co_name))

    def start(self) -> None:
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)

    @property
    def files(self) -> list[str]:
        return sorted({path for path, _ in self.calls})

    @property
    def functions(self) -> list[tuple[str, str]]:
        return sorted(set(self.calls))

    def report(self) -> dict:
        return {"files": self.files, "functions": [f"{p}:{f}" for p, f in dict.fromkeys(self.calls)]}


class StepTracer(transformers.TrainerCallback):
    """Traces optimizer step `step` of a Trainer: from the end of the step before (the run's start for step 1)."""

    def __init__(self, step: int):
        self.step, self.tracer = step, Tracer()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.step == 1:
            self.tracer.start()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            self.tracer.start()
        elif state.global_step == self.step:
            self.tracer.stop()


def _llama(seed: int = 0):
    from tests.helpers.heads import llama

    return llama(seed)


def _rows(n: int = ROWS):
    from tests.helpers.heads import lm_rows
    from tests.helpers.tiny import ListDataset

    return ListDataset(lm_rows(n, 1))


def _args(output_dir: str, **overrides) -> hf_parallel.TrainingArguments:
    from tests.helpers.harness import SGD_STEP, training_args

    settings = {**SGD_STEP, "max_steps": 4, "per_device_train_batch_size": PER_DEVICE}
    return training_args(output_dir, **{**settings, "gradient_accumulation_steps": ACCUMULATION, **overrides})


def trace_trainer(model, dataset, output_dir: str, step: int = 3, collator=None, args=None) -> dict:
    """The files and functions hf_parallel.Trainer's optimizer step `step` enters."""
    tracer = StepTracer(step)
    args = args if args is not None else _args(output_dir)
    trainer = hf_parallel.Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[tracer]
    )
    try:
        trainer.train()
    finally:
        tracer.tracer.stop()
    return tracer.tracer.report()


def _causal_lm(output_dir: str, step: int = 3) -> dict:
    return trace_trainer(_llama(), _rows(), output_dir, step)


def _first_step(output_dir: str) -> dict:
    return _causal_lm(output_dir, step=1)


def _mixtral(output_dir: str) -> dict:
    from tests.helpers.moe import CASES

    case = CASES["mixtral_moe"]
    return trace_trainer(case.build(0), _rows(), output_dir)


def _clip(output_dir: str) -> dict:
    from tests.helpers.contrastive import CASES, collate
    from tests.helpers.tiny import ListDataset

    case = CASES["clip_contrastive"]
    return trace_trainer(case.build(0), ListDataset(case.rows(ROWS, 1)), output_dir, collator=collate)


def _data_parallel(output_dir: str) -> dict:
    from hf_parallel.testing import simulate_data_parallel, simulated_training_args
    from tests.helpers.harness import SGD_STEP

    with simulate_data_parallel(2):
        args = simulated_training_args(
            2, output_dir=output_dir, report_to=[], **{**SGD_STEP, "max_steps": 4},
            per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=ACCUMULATION,
        )  # fmt: skip
        return trace_trainer(_llama(), _rows(), output_dir, args=args)


def _exact_loop(output_dir: str) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_rows(), batch_size=PER_DEVICE)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loop, tracer = hf_parallel.ExactLoop(accelerator), Tracer()
    for index, step in enumerate(loop.steps(loader)):
        if index == 2:
            tracer.start()
        for batch in step:
            with accelerator.accumulate(model):
                accelerator.backward(step.loss(model, batch))
                optimizer.step()
                optimizer.zero_grad()
        if index == 2:
            tracer.stop()
            break
    return tracer.report()


def _ddp_rank(output_dir: str) -> None:
    report = _causal_lm(output_dir)
    if torch.distributed.get_rank() == 0:
        Path(output_dir, "trace.json").write_text(json.dumps(report))


def _ddp(output_dir: str) -> dict:
    from hf_parallel.testing import spawn_cpu_ranks

    spawn_cpu_ranks(_ddp_rank, (output_dir,), timeout=240)
    return json.loads(Path(output_dir, "trace.json").read_text())


#: The runs of the trace, each `run(output_dir) -> {"files": [...], "functions": [...]}`.
RUNS: dict[str, Callable[[str], dict]] = {
    "Llama causal LM, one process": _causal_lm,
    "the same on 2 DDP ranks": _ddp,
    "its first step": _first_step,
    "Mixtral with its router loss": _mixtral,
    "CLIPModel (contrastive)": _clip,
    "nn.DataParallel on 2 virtual devices": _data_parallel,
    "an accelerate loop with ExactLoop": _exact_loop,
}


if __name__ == "__main__":  # python -m tests.helpers.trace: the table, one row per run
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name, run in RUNS.items():
        with tempfile.TemporaryDirectory() as output_dir:
            report = run(output_dir)
        print(f"| {name} | {len(report['files'])} | {len(set(report['functions']))} |", flush=True)
