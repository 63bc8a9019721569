"""
DETR-style detection exact (tests/helpers/detection.py: DETR's softmax class term with its "no object" weight,
Deformable DETR's focal one, both with auxiliary decoder layers; YOLOS; RF-DETR's query groups and IoU-aware class
term): one process equals the model's own loss and gradient on the whole step in one forward, and its own eval loss on
the whole evaluation set; gradient accumulation, torch's DataParallel (the emulation, even and with `gpu0_bsz`), 2-rank
DDP (with and without accumulation, and an epoch's padded last step) and a hand-written loop (`ExactLoop`) equal one
process. Stock is the control that must differ: a mean of micro-batch means under accumulation, and under DDP box
terms divided by the ranks' mean box count over the world size again. Then the parts: the packed targets, the model's
loss spared outside the check, LW-DETR forward by forward, RT-DETR-style losses warned.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from hf_parallel import Trainer, TrainingArguments
from hf_parallel.exact import resolve_head
from hf_parallel.exact.heads.base import LOSS_CALL_KEY, HeadMismatch, LossCallWatch
from hf_parallel.exact.heads.detection import BoxTargets, DetectionHead
from hf_parallel.exact.resolve import UnsupportedHead
from tests.helpers.detection import BOXES_PER_IMAGE, CASES, collate
from tests.helpers.harness import (
    DDP2,
    DDP2_GA2,
    DP2,
    DP3_GPU0,
    EVAL_ROWS,
    GA2,
    SGD_STEP,
    SINGLE,
    TRAIN_ROWS,
    OneProcess,
    assert_equivalent,
    exact_loop_step,
    max_relative_diff,
    own_step,
    run_case,
    run_ddp_runs,
    training_args,
)

pytest.importorskip("scipy")  # transformers' Hungarian matcher

TOL = 1e-5
single = OneProcess(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_is_the_models_own_loss_on_the_whole_step(case):
    spec = CASES[case]
    loss, grads = own_step(spec, spec.rows(TRAIN_ROWS, 1))
    with torch.no_grad():
        eval_loss = spec.build(0).eval()(**collate(spec.rows(EVAL_ROWS, 2))).loss
    result = single(case)
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL
    assert result.eval_loss == pytest.approx(eval_loss.item(), rel=TOL)


# DETR under every in-process topology; the others (the same machinery, another class term) under the two main ones.
IN_PROCESS = [
    pytest.param(case, topology, id=f"{case}-{topology.name}")
    for case, topologies in (
        ("detr_detection", (GA2, DP2, DP3_GPU0)),
        ("deformable_detr_detection", (GA2, DP2)),
        ("yolos_detection", (GA2, DP2)),
        ("rf_detr_detection", (GA2, DP2)),
    )
    for topology in topologies
]


@pytest.mark.parametrize(("case", "topology"), IN_PROCESS)
def test_in_process_topologies_equal_one_process(case, topology):
    result = run_case(CASES[case], topology)
    assert_equivalent(result, single(case), f"{case} under {topology.name}", TOL)


@pytest.mark.parametrize("case", ["detr_detection", "deformable_detr_detection", "rf_detr_detection"])
def test_control_stock_under_gradient_accumulation(case):
    """Stock averages the micro-batches' means: its images weigh by their micro-batch's boxes, not the step's."""
    stock = run_case(CASES[case], GA2, stock=True)
    assert max_relative_diff(stock.grads, single(case).grads) > 0.01


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> dict:
    runs = {f"DDP 2: {case}": (CASES[case], DDP2, False, {}) for case in CASES}
    runs.update({f"DDP 2 x GA 2: {case}": (CASES[case], DDP2_GA2, False, {}) for case in ("detr_detection",)})
    # 7 rows on 2 ranks of 4: accelerate pads the step with a duplicate image, which must add nothing.
    runs["DDP 2, 7 rows: detr_detection"] = (CASES["detr_detection"], DDP2, False, {"train_rows": 7})
    runs["stock DDP 2: detr_detection"] = (CASES["detr_detection"], DDP2, True, {})
    return run_ddp_runs(runs, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_two_ranks_equal_one_process(ddp_results):
    for name, result in ddp_results.items():
        if name.startswith("stock"):
            continue
        case = name.split(": ")[1]
        reference = run_case(CASES[case], SINGLE, train_rows=7) if "7 rows" in name else single(case)
        assert result.world_size == 2
        assert result.wrapped == "DistributedDataParallel"
        assert result.max_rank_param_diff == 0.0
        assert_equivalent(result, reference, name, TOL)
    # Stock's box terms are divided by (mean box count over the ranks) / world size: x2 on 2 ranks.
    stock = ddp_results["stock DDP 2: detr_detection"]
    assert stock.loss / single("detr_detection").loss > 1.3
    assert max_relative_diff(stock.grads, single("detr_detection").grads) > 0.3


def test_a_hand_written_loop_is_exact():
    """ExactLoop without an accelerator, 2 micro-batches of 3 and 5 images: the step's loss and gradient."""
    rows = CASES["detr_detection"].rows(TRAIN_ROWS, 1)
    loss, reference = own_step(CASES["detr_detection"], rows)
    logged, grads = exact_loop_step(CASES["detr_detection"], rows)
    assert logged == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(grads, reference) < TOL


# ---- The parts ------------------------------------------------------------------------------------------------------


def test_targets_travel_packed_by_image_and_come_back_as_the_model_takes_them():
    rows = CASES["detr_detection"].rows(4, 1)
    targets = [row["labels"] for row in rows]
    packed = BoxTargets.pack(targets)
    counts = [len(t["class_labels"]) for t in targets]
    assert packed.class_labels.shape == (4, max(counts)) and packed.boxes.shape == (4, max(counts), 4)
    assert packed.box_counts().tolist() == counts
    for original, back in zip(targets, packed.for_model(), strict=True):
        assert torch.equal(original["class_labels"], back["class_labels"])
        assert torch.equal(original["boxes"], back["boxes"])
    with pytest.raises(HeadMismatch, match="one dict per image"):
        BoxTargets.pack(torch.zeros(4, 3))


def test_counts_are_the_models_denominators_from_the_labels_alone():
    """Softmax: the class weights (1 per matched query, eos_coefficient per other), and the boxes."""
    model = CASES["detr_detection"].build(0)
    head = resolve_head(model)
    targets = [{"class_labels": torch.zeros(n, dtype=torch.long), "boxes": torch.full((n, 4), 0.5)} for n in (0, 2, 7)]
    eos, queries = model.config.eos_coefficient, model.config.num_queries
    weights = [queries * eos, 2 + (queries - 2) * eos, queries]  # 7 boxes > 5 queries: every query matched
    assert head.count({"labels": targets}).tolist() == pytest.approx([sum(weights), 9.0])


def test_the_models_own_loss_is_spared_outside_the_check():
    """The stand-in returns no loss and the auxiliary layers' predictions, as the model's loss would list them."""
    spec = CASES["deformable_detr_detection"]
    model = spec.build(0)
    head = resolve_head(model)
    batch = collate(spec.rows(4, 1))
    calls = []
    own = model.loss_function

    @functools.wraps(own)
    def counted(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    model.loss_function = counted
    watch = LossCallWatch(model, head.loss_call.arguments, instead=head.loss_call.stand_in)
    outputs = model(**batch)
    call = watch.take()
    watch.remove()
    assert not calls and outputs.loss is None
    assert len(outputs.auxiliary_outputs) == head.auxiliary_layers == 2
    sums, counts = head.row_terms(outputs, {**head.pop_labels(dict(batch)), LOSS_CALL_KEY: call})
    with torch.no_grad():
        checked = model(**collate(spec.rows(4, 1))).loss
    assert head.combine(sums.sum(0), counts.sum(0)).item() == pytest.approx(checked.item(), rel=TOL)


def test_lw_detr_is_the_models_own_loss_on_each_forward():
    """LW-DETR: RF-DETR's loss (query groups, the IoU-aware class term, the encoder's proposals) on a ViT backbone with
    batch normalisation in its projector, so that a step is exact forward by forward (the Trainer warns that a split
    step normalises each part over its own rows): the head's loss and gradient equal the model's own."""
    torch.manual_seed(0)
    backbone = transformers.LwDetrViTConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        mlp_ratio=1,
        image_size=64,
        pretrain_image_size=64,
        patch_size=16,
        num_windows=1,
        out_indices=[1, 2],
    )
    config = transformers.LwDetrConfig(
        backbone_config=backbone,
        d_model=16,
        decoder_ffn_dim=16,
        decoder_layers=2,
        decoder_self_attention_heads=2,
        decoder_cross_attention_heads=2,
        decoder_n_points=2,
        c2f_num_blocks=1,
        projector_scale_factors=[1.0],
        num_queries=5,
        group_detr=3,
        num_labels=3,
    )
    model = transformers.LwDetrForObjectDetection(config).train()
    batch = collate(CASES["detr_detection"].rows(4, 1))
    own = model(**batch).loss
    own.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    head = resolve_head(model)
    watch = LossCallWatch(model, head.loss_call.arguments, instead=head.loss_call.stand_in)
    outputs = model(**batch)
    call = watch.take()
    watch.remove()
    sums, counts = head.row_terms(outputs, {**head.pop_labels(dict(batch)), LOSS_CALL_KEY: call})
    loss = head.combine(sums.sum(0), counts.sum(0))
    loss.backward()
    assert head.name == "object_detection/grouped" and counts.sum().item() == 3 * sum(BOXES_PER_IMAGE[:4])
    assert loss.item() == pytest.approx(own.item(), rel=TOL)
    grads = {name: p.grad for name, p in model.named_parameters() if name in reference}
    assert max_relative_diff(grads, reference) < TOL


def test_rt_detr_style_losses_stay_on_the_stock_loss_with_their_reason():
    """RT-DETR's training forward is batch-coupled (denoising groups from the batch's largest box count)."""
    config = transformers.RTDetrConfig(
        backbone_config=transformers.RTDetrResNetConfig(hidden_sizes=[8, 8, 8, 8], embedding_size=8, depths=[1] * 4),
        d_model=16,
        encoder_hidden_dim=16,
        encoder_in_channels=[8, 8, 8],
        num_queries=5,
        num_labels=3,
    )
    with pytest.raises(UnsupportedHead, match="RTDetrForObjectDetectionLoss.*denoising queries"):
        resolve_head(transformers.RTDetrForObjectDetection(config))
    module = type("DetrForObjectDetection", (torch.nn.Module,), {})()  # a class of the family, without its loss
    module.config = transformers.PretrainedConfig()
    with pytest.raises(UnsupportedHead, match="not one hf_parallel computes per image"):
        resolve_head(module)


def test_heads_resolve_by_the_models_loss_function():
    names = {case: resolve_head(CASES[case].build(0)).name for case in CASES}
    assert names == {
        "detr_detection": "object_detection/softmax",
        "deformable_detr_detection": "object_detection/focal",
        "yolos_detection": "object_detection/softmax",
        "rf_detr_detection": "object_detection/grouped",
    }
    assert all(isinstance(resolve_head(CASES[case].build(0)), DetectionHead) for case in CASES)


def test_without_pillow_detection_stops_at_the_first_step_naming_the_install(monkeypatch, tmp_path):
    """transformers imports its box helpers only where Pillow is: without them its matcher stops with a NameError in
    stock's training; hf_parallel refuses at the first step with one line naming `pip install pillow`."""
    from transformers.loss import loss_for_object_detection

    monkeypatch.delattr(loss_for_object_detection, "center_to_corners_format")  # as where Pillow is not installed
    case = CASES["detr_detection"]
    stock = _detection_trainer(case, tmp_path / "stock", transformers.Trainer, transformers.TrainingArguments)
    with pytest.raises(NameError, match="center_to_corners_format"):
        stock.train()
    ours = _detection_trainer(case, tmp_path / "ours", Trainer, TrainingArguments)
    with pytest.raises(ImportError, match=r"DetrForObjectDetection's Hungarian matching .* pip install pillow\.$"):
        ours.train()
    assert ours.state.global_step == 0


def _detection_trainer(case, output_dir, trainer_cls, args_cls):
    args = training_args(output_dir, args_cls=args_cls, **{**SGD_STEP, "per_device_train_batch_size": 2})
    return trainer_cls(model=case.build(0), args=args, train_dataset=case.dataset(4), data_collator=case.collator)
