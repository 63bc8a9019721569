"""
The steady step (`hf_parallel.exact.step`): the short path every step after the first takes. Traced, it enters a
handful of hf_parallel's files and functions and no room of an engine the run does not use; trained over several
steps, it ends where one device ends (each step's rows in one forward, SGD by hand), under gradient accumulation and
DDP, for each route a head takes; stock, the control, does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForTokenClassification

import hf_parallel
from hf_parallel import Trainer
from tests.helpers.harness import SGD_STEP, Topology, max_relative_diff, run_case, run_ddp_runs, training_args
from tests.helpers.heads import CASES as HEAD_CASES
from tests.helpers.heads import Case, llama, lm_rows
from tests.helpers.modalities import CASES as MODALITY_CASES
from tests.helpers.tiny import ListDataset, tiny

PACKAGE = Path(hf_parallel.__file__).parent
MAX_FILES, MAX_FUNCTIONS = 6, 30
# The rooms of engines a one-process run does not use, the first step's machinery, and the package's face.
NOT_ENTERED = (
    "__init__.py",
    "engines/",
    "data_parallel/",
    "exact/replicas.py",
    "exact/remainder.py",
    "exact/streams.py",
    "exact/forward.py",
    "exact/check.py",
    "exact/compare.py",
    "exact/core.py",
)


class _Tracer(transformers.TrainerCallback):
    """Every hf_parallel function entered from the end of step 2 to the end of step 3 (comprehensions aside)."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def _profile(self, frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(str(PACKAGE)) and not code.co_name.startswith("<"):
            self.calls.append((Path(code.co_filename).relative_to(PACKAGE).as_posix(), code.co_name))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            sys.setprofile(self._profile)
        elif state.global_step == 3:
            sys.setprofile(None)


def _token_classifier(seed: int) -> LlamaForTokenClassification:
    torch.manual_seed(seed)
    return LlamaForTokenClassification(tiny(LlamaConfig, num_labels=3))


def _token_rows(n: int, seed: int) -> list[dict]:
    rows = lm_rows(n, seed)
    g = torch.Generator().manual_seed(seed)
    for row in rows:
        row["labels"] = torch.randint(0, 3, row["labels"].shape, generator=g).masked_fill(row["labels"] == -100, -100)
    return rows


TRACED = {"causal LM": (llama, lm_rows), "token classifier": (_token_classifier, _token_rows)}


@pytest.mark.parametrize("kind", sorted(TRACED))
def test_a_steady_step_enters_few_files_and_functions(kind, tmp_path):
    build, rows = TRACED[kind]
    tracer = _Tracer()
    args = training_args(
        tmp_path, **{**SGD_STEP, "max_steps": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    )
    trainer = Trainer(model=build(0), args=args, train_dataset=ListDataset(rows(16, 1)), callbacks=[tracer])
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
    files = sorted({path for path, _ in tracer.calls})
    functions = sorted(set(tracer.calls))
    path = "\n".join(f"{p} {f}" for p, f in dict.fromkeys(tracer.calls))
    assert ("exact/step.py", "loss") in functions, f"the steady step was not taken:\n{path}"
    assert len(files) <= MAX_FILES, f"{len(files)} files: {files}"
    assert len(functions) <= MAX_FUNCTIONS, f"{len(functions)} functions:\n{path}"
    entered = [p for p in files if p.startswith(NOT_ENTERED)]
    assert not entered, f"rooms a one-process steady step does not use: {entered}\n{path}"


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


# The other families a steady step takes: two terms (QA), choices, regression, multi-label, masked LM, images,
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
def test_steady_steps_of_every_family_equal_one_device(name):
    one, ga = _one_device(name), run_case(CASES[name], GA2, **SEVERAL)
    assert ga.steady, "the run never took the steady step"
    torch.testing.assert_close(torch.tensor(ga.losses), torch.tensor(one.losses), rtol=1e-5, atol=0)
    assert max_relative_diff(ga.params, one.params) < 1e-5


@pytest.mark.parametrize("name", ROUTES)
def test_steady_steps_equal_one_device(name):
    one = _one_device(name)
    for topology in (Topology("one process", per_device=STEP_ROWS), GA2):
        ours = run_case(CASES[name], topology, **SEVERAL)
        assert ours.steady, f"{topology.name}: the run never took the steady step"
        assert len(ours.losses) == STEPS
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(one.losses), rtol=1e-5, atol=0)
        assert max_relative_diff(ours.params, one.params) < 1e-5


def test_stock_steady_steps_under_accumulation_differ():
    """The control: stock's token classifier under accumulation is off on every step."""
    name = "bert_token_classification"
    one, stock = _one_device(name), run_case(name, GA2, stock=True, **SEVERAL)
    assert abs(stock.losses[-1] / one.losses[-1] - 1) > 0.05


@pytest.mark.full  # a spawn of 2 ranks (~8 s): .ci/run runs it in its own step; test_fsdp2's Trainer takes it too
def test_steady_steps_under_ddp_equal_one_process(tmp_path):
    """On 2 ranks over three steps; the epoch of 20 rows ends with a padded step (4 real rows of 8), which takes the
    whole way and marks the padding."""
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
        assert result.steady, f"{name}: the run never took the steady step"
        one = _one_device(name if name in CASES else runs[name][0], **runs[name][3])
        assert len(result.losses) == STEPS, name
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(one.losses), rtol=1e-5, atol=0, msg=name)
        assert max_relative_diff(result.params, one.params) < 1e-5
    one = _one_device("bert_token_classification")
    assert abs(results["stock"].losses[-1] / one.losses[-1] - 1) > 0.05


def test_the_steady_step_waits_for_the_check(tmp_path):
    """The first step is checked the whole way; the steady step is set up only once that check has decided."""
    args = training_args(tmp_path, **{**SGD_STEP, "max_steps": 1, "per_device_train_batch_size": 4})
    trainer = Trainer(model=llama(0), args=args, train_dataset=ListDataset(lm_rows(8, 1)))
    trainer.train()
    assert trainer._steady is None  # one step: the check ran in it, nothing steady yet
    trainer.args.max_steps = 2
    trainer.train()
    assert trainer._steady is not None and trainer._steady.head.name == "causal_lm/model_loss"
