"""
`hf_parallel.Trainer` through a DataParallel subclass with a forward of its own (tests/helpers/own_forward.py:
`torch.chunk`, `self.module` per chunk, a generic gather that does not keep a NamedTuple's type): every head kind
trains and evaluates with the exact loss, equal to one device on the same rows, on 2 and 4 devices and with fewer rows
than devices; only the loss terms leave the replicas in training (no logits gathered); stock, through the same class,
differs. A wrapper whose forward never calls its `module` is computed from what it gathers, warned once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.helpers.harness import Topology, max_relative_diff, run_case
from tests.helpers.heads import CASES, Case, llama, lm_rows
from tests.helpers.own_forward import chunking_data_parallel

# A CPU test on any machine: torch's DataParallel, built where CUDA is available, would move the model to GPU 0.
pytestmark = pytest.mark.usefixtures("no_gpus")

LLAMA_SMOOTHING = Case("llama_causal_lm_smoothing", llama, lm_rows, label_smoothing=0.1)
HEADS = (
    "bert_single_label",
    "bert_single_label_smoothing",
    "bert_multi_label",
    "bert_regression",
    "bert_token_classification",
    "gpt2_causal_lm",
    "llama_causal_lm",
    LLAMA_SMOOTHING,
)


@dataclass(frozen=True)
class Split:
    """`rows` training rows in steps of `devices x per_device` (the last one short), one device taking them all."""

    name: str
    devices: int
    per_device: int
    rows: int
    steps: int

    def topologies(self) -> tuple[Topology, Topology]:
        one = Topology("one device", per_device=self.devices * self.per_device)
        return one, Topology(self.name, per_device=self.per_device, dp_devices=self.devices)


SPLITS = (
    Split("3 rows on 2 devices", devices=2, per_device=2, rows=3, steps=1),  # chunks [2, 1]
    Split("5 rows on 4 devices", devices=4, per_device=2, rows=5, steps=1),  # torch.chunk: [2, 2, 1], 3 replicas
    Split("1 row on 2 devices", devices=2, per_device=1, rows=3, steps=2),  # the second step has 1 row: one replica
)
EVAL_ROWS = 5  # 2 per device: the last evaluation batch has 1 row on 2 devices


def _name(case) -> str:
    return case if isinstance(case, str) else case.name


def _run(case, topology: Topology, split: Split, stock: bool = False, **overrides):
    data_parallel = chunking_data_parallel(split.devices) if topology.dp_devices > 1 else None
    result = run_case(
        case,
        topology,
        stock=stock,
        train_rows=split.rows,
        max_steps=split.steps,
        data_parallel=data_parallel,
        **{"eval_rows": EVAL_ROWS, **overrides},
    )
    return result, data_parallel


def _same(a: float, b: float, rel: float = 1e-5) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=rel)


@pytest.mark.parametrize("split", SPLITS, ids=[s.name for s in SPLITS])
@pytest.mark.parametrize("case", HEADS, ids=[_name(c) for c in HEADS])
def test_a_data_parallel_subclass_with_its_own_forward_is_exact(case, split):
    one, topology = split.topologies()
    reference, _ = _run(case, one, split)
    result, wrapper = _run(case, topology, split)
    assert result.wrapped == "ChunkingDataParallel" and result.trainer.args.n_gpu == split.devices
    assert wrapper.chunk_sizes, "the subclass's own forward did not run"
    assert len(result.losses) == split.steps
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert _same(got, want), ("logged loss", result.losses, reference.losses)
    assert result.eval_loss == pytest.approx(reference.eval_loss, rel=1e-5), "eval_loss"
    if split.steps == 1:
        assert max_relative_diff(result.grads, reference.grads) < 1e-5, "gradient"
    # Parameters: within 1e-4 of the update the step made.
    initial = {n: p.detach() for n, p in _built(case).named_parameters()}
    update = max(float((reference.params[n] - initial[n]).abs().max()) for n in initial) or 1.0
    diff = max(float((result.params[n] - reference.params[n]).abs().max()) for n in initial)
    assert diff <= 1e-4 * update, ("parameters after training", diff, update)


def _built(case):
    return (CASES[case] if isinstance(case, str) else case).build(0)


def test_only_the_loss_terms_are_gathered_in_training():
    split = SPLITS[1]
    _, topology = split.topologies()
    result, wrapper = _run("llama_causal_lm", topology, split, eval_rows=0)
    model = result.trainer.model
    logits_bytes = split.rows * 8 * model.config.vocab_size * 4  # [rows, positions, vocabulary] fp32
    assert wrapper.chunk_sizes == [[2, 2, 1]] * 2  # the check's forward before the step, and the step's
    assert sum(wrapper.gathered_bytes) < 0.01 * logits_bytes, wrapper.gathered_bytes


@pytest.mark.parametrize("case", ("bert_single_label", "llama_causal_lm"))
def test_stock_through_the_same_subclass_differs(case):
    split = SPLITS[0]
    one, topology = split.topologies()
    reference, _ = _run(case, one, split, stock=True)
    stock, wrapper = _run(case, topology, split, stock=True)
    assert wrapper.chunk_sizes and stock.wrapped == "ChunkingDataParallel"
    # The classifier's training loss is x2 (a mean of the two chunks' means); the LM's chunk with the one-token row has
    # no target, so its training loss happens to match, and its eval_loss (a mean of batch means) does not.
    differs = {
        "loss": not _same(stock.loss, reference.loss, rel=1e-3),
        "eval_loss": not _same(stock.eval_loss, reference.eval_loss, rel=1e-3),
    }
    assert differs == {"loss": case == "bert_single_label", "eval_loss": True}, (stock, reference)


class CapturedModule(torch.nn.parallel.DataParallel):
    """A subclass whose forward runs a module it kept aside at construction, never `self.module`."""

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self.__dict__["kept"] = module  # not a submodule: the wrapper's module is the only one

    def forward(self, **kwargs):
        return self.kept(**kwargs)


def test_a_forward_that_never_calls_its_module_is_computed_from_its_outputs(hf_parallel_log):
    split = SPLITS[0]
    one, topology = split.topologies()
    reference, _ = _run("bert_single_label", one, split)
    result = run_case(
        "bert_single_label",
        topology,
        train_rows=split.rows,
        eval_rows=EVAL_ROWS,
        max_steps=1,
        data_parallel=CapturedModule,
    )
    assert result.wrapped == "CapturedModule"
    assert result.loss == pytest.approx(reference.loss, rel=1e-5)
    assert result.eval_loss == pytest.approx(reference.eval_loss, rel=1e-5)
    assert max_relative_diff(result.grads, reference.grads) < 1e-5
    warned = [m for m in hf_parallel_log.messages if "does not call its `module`" in m]
    assert len(warned) == 1, hf_parallel_log.messages
