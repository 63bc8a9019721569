"""
The exact loss adds no host-device synchronisation to a training step: after the first step (which resolves and
checks the head), hf_parallel's own code builds no tensor from Python data (on a GPU, a host-to-device copy) and reads
no tensor value back to Python (`.item()`, `int(t)`, `bool(t)`, ...: a device-to-host sync). On a CPU nothing
synchronises, so this watches for the calls that would; on a GPU, `torch.cuda.set_sync_debug_mode` says the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch.overrides import TorchFunctionMode

import hf_parallel
from hf_parallel.exact import LossHead
from tests.helpers.harness import SINGLE, TRAIN_ROWS, Topology, run_case
from tests.helpers.tiny import tiny_bert_classifier

PACKAGE = str(Path(hf_parallel.__file__).parent)
# torch's own files, told by where torch is installed: a path that merely contains "/torch/" (a virtual environment
# or checkout named so, as on some GPU images) would hide every frame under it, and pin another library's read on the
# first frame outside, in hf_parallel.
TORCH = str(Path(torch.__file__).parent) + "/"
# Tensor-from-Python-data constructors and reads of a tensor's value on the host.
SYNCING = {
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__int__",
    "__float__",
    "__bool__",
}


def _where(frame) -> str:
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"


def _caller_in(roots: tuple[str, ...]) -> str | None:
    """`file:line` of the innermost frame outside torch when its file is under one of `roots` (and, when torch's own
    code made the call, which torch frame), else None."""
    frame = sys._getframe(2)
    inner = frame
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(roots):
        return _where(frame) + ("" if inner is frame else f" via torch's {_where(inner)}")
    return None


class SyncWatcher(TorchFunctionMode):
    """Records, per optimizer step, the syncing calls made from hf_parallel's code."""

    def __init__(self, roots: tuple[str, ...] = (PACKAGE,)):
        super().__init__()
        self.roots = roots
        self.trainer = None
        self.calls: list[tuple[int, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING and self.trainer is not None:
            where = _caller_in(self.roots)
            if where is not None:
                self.calls.append((self.trainer.state.global_step, name, where))
        return func(*args, **(kwargs or {}))


class _Watch(transformers.TrainerCallback):
    def __init__(self, watcher: SyncWatcher):
        self.watcher = watcher

    def on_train_begin(self, args, state, control, **kwargs):
        self.watcher.trainer = self.trainer

    def on_train_end(self, args, state, control, **kwargs):
        self.watcher.trainer = None


CASES = ("llama_causal_lm", "bert_question_answering", "bert_single_label")
# Under DataParallel the replicas' threads are not watched (torch function modes are per thread); what runs on the
# caller's thread is: the step count, the reduction of the gathered terms.
TOPOLOGIES = (
    SINGLE,
    Topology("grad-accum 2", per_device=TRAIN_ROWS // 2, accumulation=2),
    Topology("DP 2", per_device=TRAIN_ROWS // 2, dp_devices=2),
)


def _syncs_by_step(case: str, topology: Topology, roots=(PACKAGE,)) -> list[tuple[int, str, str]]:
    watcher = SyncWatcher(roots)
    watch = _Watch(watcher)

    class Bound(hf_parallel.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            watch.trainer = self

    with watcher:
        result = run_case(
            case,
            topology,
            eval_rows=0,
            train_rows=3 * TRAIN_ROWS,
            max_steps=3,
            callbacks=(watch,),
            classes=(Bound, hf_parallel.TrainingArguments),
        )
    assert result.trainer.state.global_step == 3
    return watcher.calls


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=[t.name for t in TOPOLOGIES])
@pytest.mark.parametrize("case", CASES)
def test_no_host_sync_after_the_first_step(case, topology):
    assert [call for call in _syncs_by_step(case, topology) if call[0] > 0] == []


def test_the_watcher_sees_a_tensor_built_from_python_data(monkeypatch):
    # Control: the per-micro-batch tensor of term weights an earlier LossHead.combine built is what this catches.
    def combine_with_a_weights_tensor(self, sums, counts):
        weights = torch.tensor(self.weights, device=sums.device, dtype=sums.dtype)
        return (weights * sums / counts.to(sums.device, sums.dtype).clamp(min=1)).sum()

    monkeypatch.setattr(LossHead, "combine", combine_with_a_weights_tensor)
    calls = _syncs_by_step("bert_question_answering", SINGLE, roots=(PACKAGE, __file__))
    later = [call for call in calls if call[0] > 0]
    assert later and {name for _, name, _ in later} == {"tensor"}, calls


def test_pooling_in_the_embedding_job_reads_nothing_back():
    # embed_dataset checks for empty rows on the host, before a batch moves to the device; the embedder then pools
    # without reading the mask back.
    model = tiny_bert_classifier(0)
    ids = torch.randint(5, 30, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    embedder = hf_parallel.SequenceEmbedder(model, check_empty_rows=False).eval()
    watcher = SyncWatcher()
    watcher.trainer = _AtStep(1)
    with watcher, torch.no_grad():
        pooled = embedder(input_ids=ids, attention_mask=mask)
    assert pooled.shape == (3, model.config.hidden_size)
    assert watcher.calls == []
    watcher.calls.clear()
    with watcher, torch.no_grad():
        hf_parallel.SequenceEmbedder(model).eval()(input_ids=ids, attention_mask=mask)  # the default checks
    assert {name for _, name, _ in watcher.calls} == {"tolist"}


class _AtStep:
    """Stands in for the trainer whose step the watcher reads."""

    def __init__(self, step: int):
        self.state = transformers.TrainerState(global_step=step)
