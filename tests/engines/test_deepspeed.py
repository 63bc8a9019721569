"""
DeepSpeed ZeRO 1, 2 and 3 through the Trainer on 2 CPU ranks (gloo; accelerate shown the CPU as its accelerator by
`hf_parallel.testing.cpu_as_accelerator`), against one process without DeepSpeed on the whole step: the logged loss,
the parameters after one SGD step (gathered from their ZeRO-3 partitions) and `evaluate()`'s eval_loss.

Every case of the matrix below trains the same 8 rows in one step: 2 ranks x 4 rows (GA 1) or 2 ranks x 2 rows x
GA 2, then evaluates 7 rows, which the distributed evaluation pads with a repeat. The cases hold uneven item counts
per rank and micro-batch (a causal LM with padded rows, a token classifier with ignored tokens, a seq2seq model), a
batch-coupled loss (CLIP's contrastive loss) and a MoE LM with its router loss. ZeRO-3 is told to partition even the
tiny models' parameters (`stage3_param_persistence_threshold: 0`), so that its gather and partition run.

Controls: stock `transformers.Trainer` under the same ZeRO stages, whose token-classifier loss and update differ from
one process (it multiplies the rank's own mean by the number of ranks), and bf16, which DeepSpeed runs on the CPU.
Skipped where deepspeed is not installed (`pip install -e ".[deepspeed]"`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re

import pytest
import torch
import torch.distributed as dist
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.contrastive import CASES as CONTRASTIVE
from tests.helpers.harness import DDP2, DDP2_GA2, SINGLE, max_relative_diff, record_hf_parallel_log, run_case
from tests.helpers.heads import CASES
from tests.helpers.moe import CASES as MOE

deepspeed = pytest.importorskip("deepspeed", reason='deepspeed is not installed: pip install -e ".[deepspeed]"')

# `full`: kept out of the default suite's 10 minutes (a spawn of 2 ranks running DeepSpeed, ~40 s); .ci/run runs it in
# its own step, in the environment that has deepspeed.
pytestmark = [pytest.mark.slow, pytest.mark.full]

ALL_CASES = {**CASES, **CONTRASTIVE, **MOE}
FAMILIES = {
    "causal LM": "llama_causal_lm",
    "token classifier": "bert_token_classification",
    "seq2seq": "bart_seq2seq",
    "contrastive": "siglip_contrastive",  # CLIP: test_a_scalar_parameter_is_refused_by_name
    "MoE router loss": "mixtral_moe",
}
STAGES = (1, 2, 3)
ACCUMULATION = {1: DDP2, 2: DDP2_GA2}
TOLERANCE = 1e-5  # relative: losses, and parameters against the largest parameter
BF16_TOLERANCE = 2e-2  # bf16 carries 8 bits of mantissa: its losses agree with fp32's to about 1 %
STOCK_CASE = "bert_token_classification"  # items vary per row: stock's mean of means times the ranks shows
DEADLINE_S = 420
REFUSED = "refused:"  # a run named so must stop before its first step; its result is the error's message


def zero_config(stage: int, bf16: bool = False) -> dict:
    """A DeepSpeed config of ZeRO `stage`; "auto" takes the Trainer's values. The Trainer's SGD is a client
    optimizer, which ZeRO takes only when told to."""
    config = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": bf16},
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters by name, gathered first where ZeRO-3 partitioned them."""
    params = list(model.parameters())
    partitioned = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params) if partitioned else contextlib.nullcontext():
        return {name: p.detach().clone().float() for name, p in model.named_parameters()}


@contextlib.contextmanager
def _named(run: str):
    """A failure inside names the run it happened in."""
    try:
        yield
    except Exception as error:
        raise RuntimeError(f"{run}: {type(error).__name__}: {error}") from error


def _rank_body(runs: dict, out_path: str) -> None:
    """Each named run (case, GA, stage, stock, bf16) in turn; rank 0 saves what every run gave."""
    results = {}
    for name, (case, accumulation, stage, stock, bf16) in runs.items():
        # Each model is built as in a fresh process: with a ZeRO-3 config of an earlier run still registered,
        # transformers would partition the sub-models a constructor builds by `_from_config` (SigLIP's towers).
        unset_hf_deepspeed_config()
        if name.startswith(REFUSED):
            results[name] = _refusal(case, accumulation, stage, stock, bf16)
            continue
        with record_hf_parallel_log() as log, _named(name):
            result = run_case(
                ALL_CASES[case],
                ACCUMULATION[accumulation],
                stock=stock,
                evaluate_first=False,  # transformers evaluates before training only under ZeRO-3
                use_cpu=False,  # cpu_as_accelerator: accelerate's CPU path would drop the DeepSpeed config
                bf16=bf16,
                deepspeed=zero_config(stage, bf16),
            )
        model = result.trainer.accelerator.unwrap_model(result.trainer.model)
        results[name] = dataclasses.replace(
            result,
            params=_parameters(model),
            grads={},
            trainer=None,
            emulation=None,
            wrapped=f"{result.wrapped} {result.trainer.accelerator.distributed_type}",
        )
        results[name].warnings = log.messages
        del result, model
    if dist.get_rank() == 0:
        torch.save(results, out_path)


def _refusal(case: str, accumulation: int, stage: int, stock: bool, bf16: bool) -> str:
    """The error a run that must not start stops with (both ranks stop alike, before any collective of the step)."""
    try:
        run_case(
            ALL_CASES[case],
            ACCUMULATION[accumulation],
            stock=stock,
            evaluate_first=False,
            use_cpu=False,
            bf16=bf16,
            deepspeed=zero_config(stage, bf16),
        )
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _without_the_switch(out_path: str) -> None:
    """In a rank as a launcher starts it on a CPU-only machine (not told to use the CPU): hf_parallel's run, then
    stock's, each stopping; rank 0 saves their errors."""
    os.environ.pop("ACCELERATE_USE_CPU", None)
    errors = {stock: _refusal("llama_causal_lm", 2, 2, stock, False) for stock in (False, True)}
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    torch.save(errors, out_path)


def _runs() -> dict:
    runs = {}
    for stage in STAGES:
        for family, case in FAMILIES.items():
            for accumulation in ACCUMULATION:
                runs[f"ZeRO-{stage} {family} GA {accumulation}"] = (case, accumulation, stage, False, False)
        runs[f"ZeRO-{stage} stock token classifier GA 2"] = (STOCK_CASE, 2, stage, True, False)
    for accumulation in ACCUMULATION:
        runs[f"ZeRO-3 stock contrastive GA {accumulation}"] = (FAMILIES["contrastive"], accumulation, 3, True, False)
    runs["ZeRO-2 bf16 token classifier GA 2"] = (STOCK_CASE, 2, 2, False, True)
    runs["ZeRO-2 bf16 stock token classifier GA 2"] = (STOCK_CASE, 2, 2, True, True)
    # Last: the runs that must stop before training (their errors are the results).
    runs[f"{REFUSED} CLIP"] = ("clip_contrastive", 2, 2, False, False)
    runs[f"{REFUSED} stock CLIP"] = ("clip_contrastive", 2, 2, True, False)
    return runs


RUNS = _runs()


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory) -> dict:
    """Every run of `RUNS`, in one spawn of 2 CPU ranks."""
    out_path = str(tmp_path_factory.mktemp("deepspeed") / "results.pt")
    spawn_cpu_ranks(_rank_body, (RUNS, out_path), 2, timeout=DEADLINE_S, cpu_as_accelerator=True)
    return torch.load(out_path, weights_only=False)


@functools.cache
def reference(case: str):
    """
    One process, no DeepSpeed, the 8 rows in one batch: train, then evaluate. A contrastive loss depends on which
    rows share a batch: its evaluation batches are those of the 2 ranks together (2 x 2 rows, then the last 3).
    """
    eval_batch = 4 if case in CONTRASTIVE else 2
    result = run_case(ALL_CASES[case], SINGLE, evaluate_first=False, per_device_eval_batch_size=eval_batch)
    return dataclasses.replace(result, params={n: p.float() for n, p in result.params.items()}, trainer=None)


@pytest.mark.parametrize("accumulation", sorted(ACCUMULATION), ids=lambda ga: f"GA{ga}")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_exact_under_zero(deepspeed_results, stage, family, accumulation):
    result = deepspeed_results[f"ZeRO-{stage} {family} GA {accumulation}"]
    if stage == 3 and family == "contrastive":
        pytest.skip("ZeRO-3 partitions the contrastive scale parameters: test_contrastive_under_zero3_is_stock_warned")
    expected = reference(FAMILIES[family])
    assert result.wrapped == "DeepSpeedEngine DistributedType.DEEPSPEED", result.wrapped
    assert result.world_size == 2
    assert result.loss == pytest.approx(expected.loss, rel=TOLERANCE), "logged loss"
    assert result.train_loss == pytest.approx(expected.train_loss, rel=TOLERANCE), "train_loss"
    assert result.eval_loss == pytest.approx(expected.eval_loss, rel=TOLERANCE), "eval_loss"
    assert max_relative_diff(result.params, expected.params) < TOLERANCE, "parameters after the step"
    assert not [w for w in result.warnings if "exact_loss" in w and "fall" in w], result.warnings


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: f"ZeRO-{stage}")
def test_stock_differs_under_zero(deepspeed_results, stage):
    """The control: stock's token-classifier loss is its rank's own mean times the ranks, its update another."""
    result = deepspeed_results[f"ZeRO-{stage} stock token classifier GA 2"]
    expected = reference(STOCK_CASE)
    assert result.wrapped == "DeepSpeedEngine DistributedType.DEEPSPEED", result.wrapped
    assert result.loss / expected.loss > 2.0
    assert abs(result.eval_loss / expected.eval_loss - 1) > 0.1
    assert max_relative_diff(result.params, expected.params) > 100 * TOLERANCE


@pytest.mark.parametrize("accumulation", sorted(ACCUMULATION), ids=lambda ga: f"GA{ga}")
def test_contrastive_under_zero3_is_stock_warned(deepspeed_results, accumulation):
    """ZeRO-3 partitions SigLIP's logit_scale and logit_bias, which the loss over the step's embeddings reads outside
    the model's forward: hf_parallel falls back to the model's own loss, warned, and trains exactly as stock does."""
    result = deepspeed_results[f"ZeRO-3 contrastive GA {accumulation}"]
    stock = deepspeed_results[f"ZeRO-3 stock contrastive GA {accumulation}"]
    assert any("ZeRO-3 partitions" in w and "logit_scale, logit_bias" in w for w in result.warnings), result.warnings
    assert result.loss == pytest.approx(stock.loss, rel=TOLERANCE)
    assert result.eval_loss == pytest.approx(stock.eval_loss, rel=TOLERANCE)
    assert max_relative_diff(result.params, stock.params) < TOLERANCE


def test_bf16_under_zero_is_exact_to_its_precision(deepspeed_results):
    """DeepSpeed's bf16 on the CPU: hf_parallel's numbers are one process's to bf16's precision; stock's are not."""
    exact = deepspeed_results["ZeRO-2 bf16 token classifier GA 2"]
    stock = deepspeed_results["ZeRO-2 bf16 stock token classifier GA 2"]
    expected = reference(STOCK_CASE)
    assert exact.loss == pytest.approx(expected.loss, rel=BF16_TOLERANCE)
    assert exact.eval_loss == pytest.approx(expected.eval_loss, rel=BF16_TOLERANCE)
    assert max_relative_diff(exact.params, expected.params) < BF16_TOLERANCE
    assert stock.loss / expected.loss > 2.0


def test_the_switch_is_needed(tmp_path):
    """
    Without `cpu_as_accelerator`, accelerate takes each CPU rank for a lone process: hf_parallel's launch guard stops
    it, naming the cause; stock goes on into DeepSpeed, which stops on its batch check (if these start passing,
    accelerate learned to run DeepSpeed on CPU ranks and the switch can go).
    """
    out_path = str(tmp_path / "errors.pt")
    spawn_cpu_ranks(_without_the_switch, (out_path,), 2, timeout=DEADLINE_S)
    errors = torch.load(out_path)
    assert re.search(r"would train alone \(world_size=1", errors[False]), errors
    assert "train_batch_size is not equal to" in errors[True], errors


def test_a_scalar_parameter_is_refused_by_name(deepspeed_results):
    """
    DeepSpeed 0.19.8's engine broadcasts each parameter as bytes when it starts, which fails on CLIP's 0-dimensional
    `logit_scale` under every ZeRO stage ("self.dim() cannot be 0 to view Float as Byte"); hf_parallel refuses before
    the engine starts, naming the parameter and what to do. Stock reaches DeepSpeed's own error: the control.
    """
    refused = deepspeed_results[f"{REFUSED} CLIP"]
    assert re.search(r"0-dimensional parameters \(logit_scale\)[^\n]*DDP or FSDP2", refused), refused
    assert "self.dim() cannot be 0 to view" in deepspeed_results[f"{REFUSED} stock CLIP"]
