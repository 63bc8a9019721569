"""
The one step (`hf_parallel.exact.step`): every run, whatever its engine and head family, takes its count, its
per-micro-batch loss and its reduction. Traced, a step after the first enters a handful of hf_parallel's files and
functions, and a plain one fewer still; trained over several steps, every route ends where one device ends (each
step's rows in one forward, SGD by hand), under gradient accumulation and DDP; stock, the control, does not.
"""

from __future__ import annotations

import pytest
import torch

from hf_parallel import Trainer
from tests.helpers import trace
from tests.helpers.harness import SGD_STEP, Topology, max_relative_diff, run_case, run_ddp_runs, training_args
from tests.helpers.heads import CASES as HEAD_CASES
from tests.helpers.heads import Case, llama, lm_rows
from tests.helpers.modalities import CASES as MODALITY_CASES
from tests.helpers.tiny import ListDataset

# A step after the first, whatever its engine or family; a plain one (one process or DDP, a causal LM).
MAX_FILES, MAX_FUNCTIONS = 10, 45
PLAIN_FILES, PLAIN_FUNCTIONS = 6, 30
PLAIN = ("Llama causal LM, one process", "the same on 2 DDP ranks")
# The one step's own functions, which every run enters (a hand-written loop: those under exact/).
PIPELINE = {("exact/step.py", "count_step"), ("exact/step.py", "micro_batch_loss")}
# What a plain step never enters: the package's face, the engines and families it does not use, the check.
NOT_ENTERED = (
    "__init__.py",
    "engines/",
    "data_parallel/",
    "exact/replicas.py",
    "exact/remainder.py",
    "exact/streams.py",
    "exact/check.py",
    "exact/checked.py",
    "exact/compare.py",
    "exact/core.py",
    "exact/coupled.py",
)


def _traced(name: str, tmp_path) -> dict:
    report = trace.RUNS[name](str(tmp_path))
    functions = {tuple(entry.split(":")) for entry in report["functions"]}
    return {**report, "function_set": functions, "path": "\n".join(report["functions"])}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.full) if "DDP" in n else n for n in trace.RUNS if n != "its first step"],
)
def test_a_step_after_the_first_takes_the_one_step_through_few_files_and_functions(name, tmp_path):
    report = _traced(name, tmp_path)
    files, functions, path = report["files"], report["function_set"], report["path"]
    assert PIPELINE <= functions, f"{name}: the one step was not taken:\n{path}"
    most_files, most_functions = (PLAIN_FILES, PLAIN_FUNCTIONS) if name in PLAIN else (MAX_FILES, MAX_FUNCTIONS)
    assert len(files) <= most_files, f"{name}: {len(files)} files: {files}"
    assert len(functions) <= most_functions, f"{name}: {len(functions)} functions:\n{path}"
    if name in PLAIN:
        entered = [p for p in files if p.startswith(NOT_ENTERED)]
        assert not entered, f"parts a plain step does not use: {entered}\n{path}"


def test_the_first_step_takes_the_one_step_and_checks_the_head(tmp_path):
    report = _traced("its first step", tmp_path)
    assert PIPELINE <= report["function_set"], report["path"]
    assert ("exact/checked.py", "__call__") in report["function_set"], "the first forward was not checked"


# ---- Several steps, against one device ----

STEPS, STEP_ROWS, LR = 3, 8, 0.5
# One route each: the model's own loss given C (a Llama LM), S recomputed from the logits (a token classifier), with
# the decoder inputs built from the labels (BART), label smoothing, and collated shifted targets.
# (Llama, not GPT-2: stock's count of GPT-2's items is unshifted, so stock is no judge there.)
LLAMA_SMOOTHING = Case("llama_causal_lm_smoothing", llama, lm_rows, label_smoothing=0.1)
CASES = {**HEAD_CASES, LLAMA_SMOOTHING.name: LLAMA_SMOOTHING}
ROUTES = ("llama_causal_lm", "bert_token_classification", "bart_seq2seq", LLAMA_SMOOTHING.name)
GA2 = Topology("grad-accum 2", per_device=STEP_ROWS // 2, accumulation=2)
DDP2 = Topology("DDP 2", per_device=STEP_ROWS // 2, processes=2)
SEVERAL = dict(max_steps=STEPS, learning_rate=LR, train_rows=STEPS * STEP_ROWS, eval_rows=0)


def _one_device(name: str, **overrides):
    """The judge: stock's Trainer on one process, one batch a step, where it is exact (the model's own loss, or its
    LabelSmoother, on each step's rows in one forward), with the same SGD."""
    return run_case(CASES[name], Topology("one process", per_device=STEP_ROWS), stock=True, **{**SEVERAL, **overrides})


# The other families: two terms (QA), choices, regression, multi-label, masked LM, images,
# speech seq2seq, per-pixel, a vision-language LM.
FAMILIES = (
    "bert_question_answering",
    "bert_multiple_choice",
    "bert_regression",
    "bert_multi_label",
    "bert_masked_lm",
    "vit_image_classification",
    "whisper_speech_seq2seq",
    "segformer_segmentation",
    "llava_vlm",
)
CASES.update({name: MODALITY_CASES[name] for name in FAMILIES if name in MODALITY_CASES})


@pytest.mark.parametrize("name", FAMILIES)
def test_several_steps_of_every_family_equal_one_device(name):
    one, ga = _one_device(name), run_case(CASES[name], GA2, **SEVERAL)
    assert ga.settled, "the head was never settled"
    torch.testing.assert_close(torch.tensor(ga.losses), torch.tensor(one.losses), rtol=1e-5, atol=0)
    assert max_relative_diff(ga.params, one.params) < 1e-5


@pytest.mark.parametrize("name", ROUTES)
def test_several_steps_equal_one_device(name):
    one = _one_device(name)
    for topology in (Topology("one process", per_device=STEP_ROWS), GA2):
        ours = run_case(CASES[name], topology, **SEVERAL)
        assert ours.settled, f"{topology.name}: the head was never settled"
        assert len(ours.losses) == STEPS
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(one.losses), rtol=1e-5, atol=0)
        assert max_relative_diff(ours.params, one.params) < 1e-5


def test_stock_steps_under_accumulation_differ():
    """The control: stock's token classifier under accumulation is off on every step."""
    name = "bert_token_classification"
    one, stock = _one_device(name), run_case(name, GA2, stock=True, **SEVERAL)
    assert abs(stock.losses[-1] / one.losses[-1] - 1) > 0.05


@pytest.mark.full  # a spawn of 2 ranks (~8 s): .ci/run runs it in its own step; test_fsdp2's Trainer takes it too
def test_several_steps_under_ddp_equal_one_process(tmp_path):
    """On 2 ranks over three steps; the epoch of 20 rows ends with a padded step (4 real rows of 8), whose padding
    rows the same step leaves out."""
    padded = dict(SEVERAL, train_rows=20)
    # By name where the matrix has the case (its models are built by closures, which a spawn cannot pickle).
    # Two routes (the model's own loss given C; S from the logits): the others differ from these before the engine.
    routes = ("llama_causal_lm", "bert_token_classification")
    runs = {name: (name, DDP2, False, SEVERAL) for name in routes}
    runs["padded"] = ("bert_token_classification", DDP2, False, padded)
    runs["stock"] = ("bert_token_classification", DDP2, True, SEVERAL)
    results = run_ddp_runs(runs, tmp_path)
    for name in (*routes, "padded"):
        result = results[name]
        assert result.world_size == 2 and result.max_rank_param_diff == 0, name
        assert result.settled, f"{name}: the head was never settled"
        one = _one_device(name if name in CASES else runs[name][0], **runs[name][3])
        assert len(result.losses) == STEPS, name
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(one.losses), rtol=1e-5, atol=0, msg=name)
        assert max_relative_diff(result.params, one.params) < 1e-5
    one = _one_device("bert_token_classification")
    assert abs(results["stock"].losses[-1] / one.losses[-1] - 1) > 0.05


def test_the_head_is_settled_once_the_check_decided(tmp_path):
    """The check decides on the first step's first micro-batch, before the step is counted; the steps after it count
    the settled head, without asking the head cache again."""
    args = training_args(tmp_path, **{**SGD_STEP, "max_steps": 2, "per_device_train_batch_size": 4})
    trainer = Trainer(model=llama(0), args=args, train_dataset=ListDataset(lm_rows(8, 1)))
    trainer.train()
    assert trainer._settled_head is not None and trainer._settled_head.name == "causal_lm/model_loss", (
        trainer._settled_head
    )
