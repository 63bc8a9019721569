"""
DeepSpeed's Ulysses sequence parallelism through the Trainer (`ParallelismConfig(sp_backend="deepspeed",
sp_size=2)`), on 2 CPU ranks (gloo, accelerate shown the CPU as its accelerator): both ranks hold each row, split
along the sequence, each with its own shifted labels. Against one process on the whole step (the model's own loss in
one forward, SGD): the logged loss, the parameters after the step, and `evaluate()` (with `sp_disable_in_eval`, the
default, evaluation is plain data-parallel).

The rows are the causal LM rows of the matrix (1 to 8 real tokens in 8 positions, right-padded, labels -100 on the
padding) with `position_ids` and no attention mask (Ulysses masks by position; with right padding the real tokens'
logits are those of the masked forward). ZeRO 1, 2 and 3 x GA 1 (4 rows: rank 0's batch; the step ends before
rank 1's, which accelerate fills with repeats, warned) and GA 2 (8 rows).

Control: stock `transformers.Trainer` is exact at GA 1, but at GA 2 its loss is the mean of each micro-batch's own
token mean (the update ~10 % off here) and its eval_loss the mean of the batches' means.

A process registers Ulysses' attention over `ALL_ATTENTION_FUNCTIONS["sdpa"]` and keeps one sequence-parallel group:
each run here restores the first and releases the second, so that several runs share one spawn.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import hf_parallel
from hf_parallel.testing import spawn_cpu_ranks
from tests.engines.test_deepspeed import zero_config
from tests.helpers.harness import (
    SGD_STEP,
    SINGLE,
    Capture,
    max_relative_diff,
    record_hf_parallel_log,
    run_case,
    training_args,
)
from tests.helpers.heads import llama, lm_rows
from tests.helpers.tiny import ListDataset

deepspeed = pytest.importorskip("deepspeed", reason='deepspeed is not installed: pip install -e ".[deepspeed]"')

# `full`: kept out of the default suite's 10 minutes (a spawn of 2 ranks running DeepSpeed); .ci/run runs it in its own
# step, in the environment that has deepspeed.
pytestmark = [pytest.mark.slow, pytest.mark.full]

SP_SIZE, PER_DEVICE, EVAL_ROWS = 2, 4, 7
STAGES = (1, 2, 3)
ACCUMULATION = (1, 2)
TOLERANCE = 1e-5
DEADLINE_S = 420


def sp_rows(n: int, seed: int) -> list[dict]:
    """The causal LM rows with their positions and without the attention mask."""
    rows = []
    for row in lm_rows(n, seed):
        row = {key: value for key, value in row.items() if key != "attention_mask"}
        rows.append({**row, "position_ids": torch.arange(row["input_ids"].shape[0])})
    return rows


@contextlib.contextmanager
def _fresh_sequence_parallelism():
    """What one sequence-parallel run leaves in its process undone after it: Ulysses' attention and SP group."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    unset_hf_deepspeed_config()  # the model is built as in a fresh process, not partitioned at construction
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        parallel_state_sp._release_sequence_parallel_groups()


def run_sp(stage: int, accumulation: int, stock: bool, rows: int | None = None) -> dict:
    """One training under sequence parallelism (one step of `PER_DEVICE x accumulation` rows; with `rows`, one epoch
    of that many), gathered parameters and evaluation."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    trainer_cls, args_cls = (
        (transformers.Trainer, transformers.TrainingArguments)
        if stock
        else (hf_parallel.Trainer, hf_parallel.TrainingArguments)
    )
    parallelism = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=SP_SIZE,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
    )
    capture = Capture()
    with _fresh_sequence_parallelism(), tempfile.TemporaryDirectory() as tmp, record_hf_parallel_log() as log:
        arguments = {
            **SGD_STEP,
            "use_cpu": False,
            "deepspeed": zero_config(stage),
            "per_device_train_batch_size": PER_DEVICE,
            "gradient_accumulation_steps": accumulation,
            "parallelism_config": parallelism,
            **({"max_steps": -1, "num_train_epochs": 1} if rows else {}),
        }
        trainer = trainer_cls(
            model=llama(0),
            args=training_args(tmp, args_cls=args_cls, **arguments),
            train_dataset=ListDataset(sp_rows(rows or PER_DEVICE * accumulation, 1)),
            eval_dataset=ListDataset(sp_rows(EVAL_ROWS, 2)),
            callbacks=[capture],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
        model = trainer.accelerator.unwrap_model(trainer.model)
        params = list(model.parameters())
        partitioned = any(hasattr(p, "ds_id") for p in params)
        with deepspeed.zero.GatheredParameters(params) if partitioned else contextlib.nullcontext():
            weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        eval_loss = trainer.evaluate()["eval_loss"]
        sp_size = trainer.get_sp_size()
    return {"loss": capture.loss, "params": weights, "eval_loss": eval_loss, "sp": sp_size, "log": log.text}


def _worker(runs: list[tuple[int, int, bool]], out_path: str) -> None:
    results = {run: run_sp(*run) for run in runs}
    if dist.get_rank() == 0:
        torch.save(results, out_path)


PADDED = (2, 1, False, 6)  # 6 rows in a global batch of 2 ranks x 4: accelerate repeats 2 to fill it
RUNS = [(stage, ga, False) for stage in STAGES for ga in ACCUMULATION] + [(2, 2, True), PADDED]


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory) -> dict:
    out_path = str(tmp_path_factory.mktemp("sequence_parallel") / "results.pt")
    spawn_cpu_ranks(_worker, (RUNS, out_path), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
    return torch.load(out_path, weights_only=False)


@functools.cache
def reference(rows: int):
    """One process, no DeepSpeed: the same rows with their attention mask, in one batch; then the evaluation."""
    return run_case("llama_causal_lm", SINGLE, evaluate_first=False, train_rows=rows, per_device_train_batch_size=rows)


@pytest.mark.parametrize("accumulation", ACCUMULATION, ids=lambda ga: f"GA{ga}")
@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_sequence_parallelism_is_exact(sp_results, stage, accumulation):
    result, expected = sp_results[(stage, accumulation, False)], reference(PER_DEVICE * accumulation)
    assert result["sp"] == SP_SIZE
    assert "left to the Trainer" not in result["log"], result["log"]  # no fallback
    assert result["loss"] == pytest.approx(expected.loss, rel=TOLERANCE), "logged loss"
    assert max_relative_diff(result["params"], expected.params) < TOLERANCE, "parameters after the step"
    assert result["eval_loss"] == pytest.approx(expected.eval_loss, rel=TOLERANCE), "eval_loss"


def test_stock_sequence_parallelism_differs_under_accumulation(sp_results):
    result, expected = sp_results[(2, 2, True)], reference(PER_DEVICE * 2)
    assert max_relative_diff(result["params"], expected.params) > 100 * TOLERANCE
    assert abs(result["eval_loss"] / expected.eval_loss - 1) > 100 * TOLERANCE


def test_the_rows_repeated_to_fill_an_epoch_are_warned(sp_results):
    """Under sequence parallelism the repeated rows of an epoch's last global batch are not told apart: warned."""
    assert "(only 6 of its rows are real)" in sp_results[PADDED]["log"]
    assert "rows are real" not in sp_results[(2, 2, False)]["log"]  # 8 rows: one whole global batch
