"""
The exact loss: one process with batch 2B == DDP 2 ranks x B == simulated DataParallel (even, uneven, balanced)
== gradient accumulation 2, for every head; and stock transformers differs, by the factors the README's table gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.data.data_collator import default_data_collator
from transformers.trainer_pt_utils import LabelSmoother

import hf_parallel
from hf_parallel import Trainer
from tests.helpers.compare import assert_losses_close
from tests.helpers.epochs import EPOCH, ITERABLE, epoch_topology, one_device_epoch, update_error
from tests.helpers.harness import (
    SGD_STEP,
    SINGLE,
    TRAIN_ROWS,
    Capture,
    RunResult,
    Topology,
    assert_equivalent,
    max_relative_diff,
    run_case,
    run_ddp_runs,
    training_args,
)
from tests.helpers.heads import CASES, lm_rows
from tests.helpers.tiny import ListDataset

TOL = 1e-5
CASE_NAMES = tuple(CASES)
IN_PROCESS = (
    Topology("grad-accum 2", per_device=TRAIN_ROWS // 2, accumulation=2),
    Topology("DP 2", per_device=TRAIN_ROWS // 2, dp_devices=2),
    Topology("DP 3 split [3,3,2]", per_device=3, dp_devices=3),
    Topology("DP 4 fewer chunks [3,3,2]", per_device=3, dp_devices=4),
    Topology("DP 3 balanced gpu0_bsz=0", per_device=3, dp_devices=3, gpu0_bsz=0),
    Topology("DP 3 balanced gpu0_bsz=1", per_device=3, dp_devices=3, gpu0_bsz=1),
    Topology("DP 3 balanced gpu0_weight=0.5", per_device=3, dp_devices=3, gpu0_weight=0.5),
    Topology("DP 3 + grad-accum 2", per_device=2, dp_devices=3, accumulation=2),
)
# The split rules added last (fewer chunks than devices, GPU 0 without rows, a weighted GPU 0) change which rows reach
# which replica, not how a head computes its terms: by default they run on one case per head kind. Every case still
# runs under the other topologies, which hold the same paths (an uneven split, the balanced wrapper, DataParallel with
# GA). The other cases' rows run on request, with the whole zoo: `pytest -m full` (the `full` marker).
ON_REQUEST = pytest.mark.full
SPLIT_RULES = {"DP 4 fewer chunks [3,3,2]", "DP 3 balanced gpu0_bsz=0", "DP 3 balanced gpu0_weight=0.5"}
ONE_CASE_PER_HEAD_KIND = (
    "llama_causal_lm",
    "bart_seq2seq",
    "bert_masked_lm",
    "bert_token_classification",
    "bert_single_label",
    "bert_multi_label",
    "bert_regression",
    "bert_multiple_choice",
    "bert_question_answering",
)
MATRIX = [
    pytest.param(
        case,
        topology,
        id=f"{case}-{topology.name}",
        marks=[ON_REQUEST] if topology.name in SPLIT_RULES and case not in ONE_CASE_PER_HEAD_KIND else [],
    )
    for topology in IN_PROCESS
    for case in CASE_NAMES
]

_single_cache: dict[str, RunResult] = {}


def single(case: str) -> RunResult:
    if case not in _single_cache:
        _single_cache[case] = run_case(case, SINGLE)
    return _single_cache[case]


# ---- The reference: what one device computes on the whole step --------------------------------------------------


@pytest.mark.parametrize("case", CASE_NAMES)
def test_single_process_equals_the_model_loss_on_the_whole_batch(case):
    """The model's own mean loss over all 2B rows, by hand: the definition of exact."""
    spec = CASES[case]
    model = spec.build(0)
    batch = default_data_collator(spec.rows(TRAIN_ROWS, 1))
    if spec.label_smoothing:
        labels = batch.pop("labels")
        outputs = model(**batch)
        shift = isinstance(model, transformers.GPT2LMHeadModel)
        loss = LabelSmoother(epsilon=spec.label_smoothing)(outputs, labels, shift_labels=shift)
    else:
        loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    result = single(case)
    assert result.loss == pytest.approx(loss.item(), rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL


# ---- The matrix ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "topology"), MATRIX)
def test_in_process_topologies_equal_one_process(case, topology):
    result = run_case(case, topology)
    if topology.dp_devices > 1:
        balanced = topology.gpu0_bsz is not None or topology.gpu0_weight is not None
        assert result.wrapped == ("BalancedDataParallel" if balanced else "ExactDataParallel")
    assert_equivalent(result, single(case), f"{case} under {topology.name}")


# The Seq2SeqTrainer is no head kind of its own: bart_seq2seq has the split rules' rows (the Seq2SeqTrainer's, on
# request: `pytest -m full`).
SEQ2SEQ_TOPOLOGIES = [
    pytest.param(t, id=t.name, marks=[ON_REQUEST] if t.name in SPLIT_RULES else []) for t in IN_PROCESS
]


@pytest.mark.parametrize("topology", SEQ2SEQ_TOPOLOGIES)
def test_seq2seq_trainer_row(topology):
    """hf_parallel.Seq2SeqTrainer, generating in evaluation: the same exact step and eval_loss as the Trainer's."""
    classes = (hf_parallel.Seq2SeqTrainer, hf_parallel.Seq2SeqTrainingArguments)
    result = run_case("bart_seq2seq", topology, classes=classes, predict_with_generate=True, generation_max_length=4)
    assert_equivalent(result, single("bart_seq2seq"), f"Seq2SeqTrainer under {topology.name}")


# Every 2-rank DDP run of this file, the epoch remainder's included, in one spawn of 2 CPU ranks (each spawn costs
# seconds of imports): run name -> result. Each test checks its own runs.
DDP2 = Topology("DDP 2", per_device=TRAIN_ROWS // 2, processes=2)
DDP2_GA2 = Topology("DDP 2 x grad-accum 2", per_device=TRAIN_ROWS // 4, accumulation=2, processes=2)
GA_CASES = ["llama_causal_lm", "bert_token_classification", "bert_question_answering"]
UNLOGGED_CASES = ["gpt2_causal_lm", "bert_single_label"]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> dict:
    runs = {f"DDP 2: {case}": (case, DDP2, False, {}) for case in CASE_NAMES}
    runs.update({f"{DDP2_GA2.name}: {case}": (case, DDP2_GA2, False, {}) for case in GA_CASES})
    runs.update({f"unlogged: {case}": (case, DDP2, False, {"logging_steps": 1000}) for case in UNLOGGED_CASES})
    runs["stock DDP 2: bert_single_label"] = ("bert_single_label", DDP2, True, {})
    runs.update({f"epoch: {name}": run for name, run in _epoch_runs().items()})
    return run_ddp_runs(runs, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_two_ranks_equal_one_process(ddp_results):
    for case in CASE_NAMES:
        result = ddp_results[f"DDP 2: {case}"]
        assert result.world_size == 2
        assert result.parallel_mode == "ParallelMode.DISTRIBUTED"
        # evaluate() ran before train(): the model must still train wrapped in DDP, with equal ranks.
        assert result.wrapped == "DistributedDataParallel"
        assert result.max_rank_param_diff == 0.0
        assert_equivalent(result, single(case), f"{case} under DDP 2")


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_with_gradient_accumulation_equals_one_process(ddp_results):
    for case in GA_CASES:
        result = ddp_results[f"{DDP2_GA2.name}: {case}"]
        assert result.world_size == 2
        assert result.wrapped == "DistributedDataParallel"
        assert result.max_rank_param_diff == 0.0
        assert_equivalent(result, single(case), f"{case} under {DDP2_GA2.name}")
        assert result.train_loss == pytest.approx(single(case).loss, rel=TOL)


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_train_loss_of_unlogged_steps_is_the_global_loss(ddp_results):
    """With no logging step before the end, train_loss comes from each rank's remainder: averaged, not local."""
    for case in UNLOGGED_CASES:
        result = ddp_results[f"unlogged: {case}"]
        assert result.world_size == 2
        assert result.loss is None  # nothing was logged during training
        assert result.train_loss == pytest.approx(single(case).loss, rel=TOL)


# ---- Controls: stock transformers differs, as the README says -----------------------------------------------------


def test_control_stock_gradient_accumulation_doubles_the_classifier_loss():
    topology = IN_PROCESS[0]
    stock = run_case("bert_single_label", topology, stock=True)
    assert stock.loss / single("bert_single_label").loss == pytest.approx(2.0, rel=1e-4)
    assert max_relative_diff(stock.grads, single("bert_single_label").grads) > 0.5


def test_control_stock_gpt2_counts_unshifted_tokens():
    """GPT2LMHeadModel has no loss_type, so stock divides by labels != -100 before the shift."""
    stock = run_case("gpt2_causal_lm", SINGLE, stock=True)
    labels = torch.stack([row["labels"] for row in lm_rows(TRAIN_ROWS, 1)])
    shifted, unshifted = labels[:, 1:].ne(-100).sum().item(), labels.ne(-100).sum().item()
    assert shifted < unshifted
    assert stock.loss == pytest.approx(single("gpt2_causal_lm").loss * shifted / unshifted, rel=TOL)


@pytest.mark.parametrize(
    ("case", "topology", "rows"),
    [
        ("bert_single_label", Topology("DP 2 split [2,1]", per_device=2, dp_devices=2), 3),
        ("bert_single_label", Topology("DP 4, 5 rows [2,2,1]", per_device=2, dp_devices=4), 5),
        ("llama_causal_lm", Topology("DP 4, 5 rows [2,2,1]", per_device=2, dp_devices=4), 5),
        ("bert_single_label_smoothing", Topology("DP 2", per_device=4, dp_devices=2), 8),
    ],
    ids=["cls-DP2-[2,1]", "cls-DP4-5rows", "lm-DP4-5rows", "smoothing-DP2"],
)
def test_control_stock_data_parallel_is_wrong_and_exact_is_not(case, topology, rows):
    reference = run_case(case, SINGLE, train_rows=rows)
    stock = run_case(case, topology, stock=True, train_rows=rows)
    ours = run_case(case, topology, train_rows=rows)
    assert abs(stock.loss / reference.loss - 1) > 0.05
    assert max_relative_diff(stock.grads, reference.grads) > 0.05
    assert ours.loss == pytest.approx(reference.loss, rel=TOL)
    assert max_relative_diff(ours.grads, reference.grads) < TOL


def one_target_rows(n: int, seed: int) -> list[dict]:
    """A causal LM batch with a single prediction target in all: every row one token, but one row with two."""
    rows = lm_rows(n, seed)
    for i, row in enumerate(rows):
        keep = 2 if i == 1 else 1
        row["attention_mask"] = (torch.arange(len(row["input_ids"])) < keep).long()
        row["input_ids"] = row["input_ids"].clamp(min=5) * row["attention_mask"]
        row["labels"] = row["input_ids"].masked_fill(row["attention_mask"] == 0, -100)
    return rows


def test_control_stock_nan_with_one_target_and_averaging_off(monkeypatch):
    from tests.helpers import heads

    monkeypatch.setitem(heads.CASES, "one_target", heads.Case("one_target", heads.llama, one_target_rows))
    topology = Topology("DP 2", per_device=2, dp_devices=2)
    stock = run_case("one_target", topology, stock=True, train_rows=4, average_tokens_across_devices=False)
    assert not torch.isfinite(torch.tensor(stock.loss))
    assert not all(torch.isfinite(p).all() for p in stock.params.values())

    reference = run_case("one_target", SINGLE, train_rows=4)
    ours = run_case("one_target", topology, train_rows=4, average_tokens_across_devices=False)
    assert torch.isfinite(torch.tensor(ours.loss))
    assert ours.loss == pytest.approx(reference.loss, rel=TOL)
    assert max_relative_diff(ours.grads, reference.grads) < TOL


def test_control_stock_eval_loss_is_a_mean_of_batch_means():
    stock = run_case("bert_masked_lm", SINGLE, stock=True)
    ours = single("bert_masked_lm")
    assert abs(stock.eval_loss / ours.eval_loss - 1) > 1e-3


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_control_stock_ddp(ddp_results):
    """Stock under 2-rank DDP: the classifier's loss and gradient x2, and evaluate() before train() skips DDP."""
    stock = ddp_results["stock DDP 2: bert_single_label"]
    assert stock.world_size == 2
    assert stock.wrapped != "DistributedDataParallel"  # the trap: never wrapped after evaluate()
    assert stock.max_rank_param_diff > 0  # so the ranks drifted apart
    assert stock.loss / single("bert_single_label").loss == pytest.approx(2.0, rel=1e-4)


# ---- Edges ---------------------------------------------------------------------------------------------------------


def no_target_rows(n: int, seed: int) -> list[dict]:
    rows = lm_rows(n, seed)
    for row in rows:
        row["labels"] = torch.full_like(row["labels"], -100)
    return rows


@pytest.mark.parametrize("topology", [SINGLE, IN_PROCESS[1]], ids=["single", "DP 2"])
def test_a_step_without_targets_contributes_zero_not_nan(monkeypatch, topology):
    from tests.helpers import heads

    monkeypatch.setitem(heads.CASES, "no_target", heads.Case("no_target", heads._gpt2, no_target_rows))
    result = run_case("no_target", topology)
    assert result.loss == 0.0
    assert result.eval_loss == 0.0
    assert all(g.abs().max().item() == 0.0 for g in result.grads.values())


def test_exact_loss_off_is_stock():
    topology = IN_PROCESS[0]
    ours = run_case("bert_single_label", topology, exact_loss=False)
    stock = run_case("bert_single_label", topology, stock=True)
    assert ours.loss == stock.loss
    assert ours.eval_loss == stock.eval_loss
    assert max_relative_diff(ours.grads, stock.grads) == 0.0


def sum_over_items(outputs, labels, num_items_in_batch):
    """A user loss in the transformers convention: a sum divided by the count it is given."""
    logits = outputs["logits"]
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / num_items_in_batch


@pytest.mark.parametrize("topology", [SINGLE, IN_PROCESS[0], IN_PROCESS[2]], ids=["single", "GA 2", "DP 3"])
def test_user_compute_loss_func_stays_exact(tmp_path, topology):
    case = CASES["bert_single_label"]
    capture = Capture()
    trainer = Trainer(
        model=case.build(0),
        args=training_args(tmp_path, args_cls=transformers.TrainingArguments, **SGD_STEP, **topology.arguments()),
        train_dataset=case.dataset(TRAIN_ROWS, seed=1),
        compute_loss_func=sum_over_items,
        callbacks=[capture],
    )
    if topology.dp_devices > 1:
        from hf_parallel.testing import simulate_data_parallel

        with simulate_data_parallel(topology.dp_devices):
            trainer.train()
    else:
        trainer.train()
    assert capture.losses[0] == pytest.approx(single("bert_single_label").loss, rel=TOL)


class TinyCustom(torch.nn.Module):
    """Not a transformers head: the loss it returns cannot be recomputed from its outputs."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def test_unknown_head_falls_back_to_stock_with_one_warning(tmp_path, hf_parallel_log):
    g = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(4, generator=g), "labels": torch.tensor(i % 2)} for i in range(8)]
    losses = {}
    for name, trainer_cls in (("ours", Trainer), ("stock", transformers.Trainer)):
        torch.manual_seed(0)
        trainer = trainer_cls(
            model=TinyCustom(),
            args=training_args(
                tmp_path / name,
                args_cls=transformers.TrainingArguments,
                **{**SGD_STEP, **IN_PROCESS[0].arguments(), "max_steps": 2},
            ),
            train_dataset=ListDataset(rows),
        )
        losses[name] = trainer.train().training_loss
    assert losses["ours"] == losses["stock"]
    fallbacks = [m for m in hf_parallel_log.messages if m.startswith("exact_loss:")]
    assert len(fallbacks) == 1, hf_parallel_log.messages
    assert "TinyCustom has no `config`" in fallbacks[0]


def test_overridden_compute_loss_falls_back_with_a_warning(tmp_path, hf_parallel_log):
    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    case = CASES["bert_single_label"]
    trainer = MyTrainer(
        model=case.build(0),
        args=training_args(tmp_path, args_cls=transformers.TrainingArguments, **SGD_STEP, **SINGLE.arguments()),
        train_dataset=case.dataset(TRAIN_ROWS, seed=1),
    )
    trainer.train()
    assert any("MyTrainer overrides compute_loss" in m for m in hf_parallel_log.messages), hf_parallel_log.messages


def test_question_answering_without_a_sequence_length_is_a_clear_error():
    from hf_parallel.exact import QuestionAnsweringHead

    head = QuestionAnsweringHead()
    labels = {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 9])}
    assert head.count(labels, seq_len=8).tolist() == [2, 1]
    with pytest.raises(ValueError, match="no input_ids or attention_mask"):
        head.count(labels, seq_len=None)


# ---- The epoch remainder: the last step of an epoch under DDP trains the real leftover rows only -------------------

EPOCH_RUNS = {
    # name: (case, rows, per-device batch, gradient accumulation)
    "classifier, 10 rows, 2 x 4": ("bert_single_label", 10, 4, 1),
    "classifier, 10 rows, 2 x 2 x GA 2": ("bert_single_label", 10, 2, 2),
    "causal LM, 10 rows, 2 x 4": ("llama_causal_lm", 10, 4, 1),
    "causal LM, 10 rows, 2 x 2 x GA 2": ("llama_causal_lm", 10, 2, 2),
    "QA, 10 rows, 2 x 4": ("bert_question_answering", 10, 4, 1),
    "classifier, 9 rows, 2 x 4": ("bert_single_label", 9, 4, 1),  # one real row in the last step
}
EPOCH_RUNS_ITERABLE = {
    "iterable classifier, 9 rows, 2 x 4": ("bert_single_label", 9, 4, 1),
    "iterable causal LM, 9 rows, 2 x 4": ("llama_causal_lm", 9, 4, 1),
}


def _epoch_runs() -> dict:
    """The epoch remainder's DDP runs (in the spawn of `ddp_results`): name -> (case, topology, stock, overrides)."""
    runs = {
        name: (case, epoch_topology(per_device, accumulation), False, {"train_rows": rows, **EPOCH})
        for name, (case, rows, per_device, accumulation) in EPOCH_RUNS.items()
    }
    for name, (case, rows, per_device, accumulation) in EPOCH_RUNS_ITERABLE.items():
        runs[name] = (
            case,
            epoch_topology(per_device, accumulation),
            False,
            {"train_rows": rows, **EPOCH, **ITERABLE},
        )
    # Controls: stock on the first case, and dataloader_drop_last=True (no remainder step at all).
    runs["stock"] = ("bert_single_label", epoch_topology(4, 1), True, {"train_rows": 10, **EPOCH})
    runs["drop_last"] = (
        "bert_single_label", epoch_topology(4, 1), False,
        {"train_rows": 10, "dataloader_drop_last": True, **EPOCH},
    )  # fmt: skip
    return runs


@pytest.fixture(scope="module")
def epoch_results(ddp_results) -> dict:
    prefix = "epoch: "
    return {name[len(prefix) :]: result for name, result in ddp_results.items() if name.startswith(prefix)}


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~12-19 s): .ci/run runs the full step
@pytest.mark.parametrize("name", [*EPOCH_RUNS, *EPOCH_RUNS_ITERABLE])
def test_the_last_step_of_an_epoch_equals_one_device_on_the_leftover_rows(name, epoch_results):
    iterable = name in EPOCH_RUNS_ITERABLE
    case, rows, _, _ = (EPOCH_RUNS_ITERABLE if iterable else EPOCH_RUNS)[name]
    result, reference = epoch_results[name], one_device_epoch(case, rows, **(ITERABLE if iterable else {}))
    assert result.world_size == 2 and result.wrapped == "DistributedDataParallel"
    assert result.max_rank_param_diff == 0.0
    assert len(reference.losses) == 2 and len(result.losses) == 2  # rows 0-7, then the leftover rows
    assert_losses_close(result.losses, reference.losses, name)
    assert result.train_loss == pytest.approx(reference.train_loss, rel=1e-5), name
    initial = {n: p.detach() for n, p in CASES[case].build(0).named_parameters()}
    assert update_error(result.params, reference.params, initial) < 1e-4, name


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~12-19 s): .ci/run runs the full step
def test_epoch_remainder_controls(epoch_results):
    reference = one_device_epoch("bert_single_label", 10)
    initial = {n: p.detach() for n, p in CASES["bert_single_label"].build(0).named_parameters()}
    # Stock trains the padded duplicates (and doubles the loss under DDP): far from one device.
    stock = epoch_results["stock"]
    assert stock.losses[1] != pytest.approx(reference.losses[1], rel=1e-2)
    assert update_error(stock.params, reference.params, initial) > 0.1
    # dataloader_drop_last=True: one step on rows 0-7, as one device dropping the last 2 rows.
    dropped = epoch_results["drop_last"]
    one_step = one_device_epoch("bert_single_label", 10, dataloader_drop_last=True)
    assert len(dropped.losses) == len(one_step.losses) == 1
    assert_losses_close(dropped.losses, one_step.losses, "drop_last")
    assert update_error(dropped.params, one_step.params, initial) < 1e-4
