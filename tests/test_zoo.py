"""
The model is the judge of its own loss (`hf_parallel.exact.check`): a sample of each head kind of the model zoo
(`benchmarks.zoo`) is exact or warned, never silently different, never a crash; a standalone decoder whose loss is
unshifted is exact in one process, with gradient accumulation, under DataParallel and DDP; the decisions of the
check; decoder inputs of encoder-decoders without `prepare_decoder_input_ids_from_labels`, and of FSMT, whose forward
builds other decoder inputs than its `prepare_decoder_input_ids_from_labels`. The whole zoo is `slow`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    BartConfig,
    BartForCausalLM,
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    FSMTConfig,
    FSMTForConditionalGeneration,
)
from transformers.data.data_collator import default_data_collator
from transformers.trainer_pt_utils import LabelSmoother

from benchmarks.zoo import check_model, report
from benchmarks.zoo_models import HEAD_KINDS, ROUTER_KIND, ZooModel, zoo_models
from hf_parallel.exact import CrossEntropyHead
from hf_parallel.exact.compare import candidate_heads
from hf_parallel.exact.heads.decoder import LabelsInForwardHead, decoder_input_ids, watch_decoder
from hf_parallel.exact.resolve import resolve_head
from tests.helpers.harness import TRAIN_ROWS, Topology, max_relative_diff, run_case, run_ddp_runs
from tests.helpers.heads import CASES, Case, lm_rows, seq2seq_rows
from tests.helpers.tiny import VOCAB, tiny

TOL = 1e-5

# One or more classes of each head kind, and the classes the class name alone got wrong: unshifted standalone
# decoders (Bart), a loss the logits do not carry (ProphetNet), encoder-decoders without
# prepare_decoder_input_ids_from_labels (Blenderbot), or whose forward builds others than it does (FSMT). The slow
# sweep has the rest.
SAMPLE = {
    "LlamaForCausalLM": "exact",
    "BartForCausalLM": "exact",
    "ProphetNetForCausalLM": "fallback",
    "BlenderbotForConditionalGeneration": "exact",
    "FSMTForConditionalGeneration": "exact",
    "BertForMaskedLM": "exact",
    "BertForTokenClassification": "exact",
    "BertForSequenceClassification": "exact",
    "BertForMultipleChoice": "exact",
    "BertForQuestionAnswering": "exact",
}
# Beyond text, one or more classes per family (ours, stock): exact where stock averages its own loss (x2), a summed CTC
# loss that stock gets right too, a vision-language LM whose loss honours the count, a segmentation model with an
# auxiliary head (its logits recorded from the head), DETR (each image matched to its own boxes), models with batch
# normalisation, RF-DETR (its query groups), and the fallbacks with a reason (x-vectors, masked image modeling).
MEDIA_SAMPLE = {
    "ViTForImageClassification": ("exact", "exact"),
    "VideoMAEForVideoClassification": ("exact", "exact"),
    "Wav2Vec2ForSequenceClassification": ("exact", "silent"),
    "Wav2Vec2ForCTC": ("exact", "exact"),
    "Wav2Vec2ForAudioFrameClassification": ("exact", "silent"),
    "Wav2Vec2ForXVector": ("fallback", "silent"),
    "WhisperForConditionalGeneration": ("exact", "silent"),
    "Speech2TextForConditionalGeneration": ("exact", "silent"),
    "LlavaForConditionalGeneration": ("exact", "exact"),
    "Qwen2VLForConditionalGeneration": ("exact", "exact"),
    "DPTForSemanticSegmentation": ("exact", "silent"),  # with its auxiliary head's loss
    "ViTForMaskedImageModeling": ("fallback", "silent"),
    "DetrForObjectDetection": ("exact", "silent"),  # its timm backbone built as a transformers ResNet
    "RfDetrForObjectDetection": ("exact", "silent"),  # its query groups, each image matched in each group
    # Batch normalisation: judged against the model's own losses on each micro-batch (`Outcome.reference`).
    "ResNetForImageClassification": ("exact", "silent"),
    "UperNetForSemanticSegmentation": ("exact", "silent"),
}
# The classes above whose forward depends on the rest of the batch.
PER_MICRO_BATCH = {"ResNetForImageClassification", "UperNetForSemanticSegmentation"}
ZOO = {model.name: model for model in zoo_models([*HEAD_KINDS])}  # each class under its own kind
# Batch-coupled losses (ours; stock is never exact): contrastive dual encoders under gradient accumulation (the cached
# two-pass; stock scores each micro-batch against itself), and MoE LMs with their router loss on under DataParallel
# (stock averages the replicas' router terms, or cannot gather the router logits its replicas recorded twice).
COUPLED_SAMPLE = {
    ("CLIPModel", "zero_shot_image_classification"): "exact",
    ("SiglipModel", "zero_shot_image_classification"): "exact",
    ("Qwen3MoeForCausalLM", ROUTER_KIND): "exact",
    ("JetMoeForCausalLM", ROUTER_KIND): "fallback",  # its router loss is another: warned
}


@pytest.mark.parametrize("name", list(SAMPLE))
def test_a_sample_of_the_zoo_is_exact_or_warned(name):
    outcome = check_model(ZOO[name])
    assert outcome.ours == SAMPLE[name], outcome
    if name == "BartForCausalLM":
        assert outcome.stock == "silent", outcome  # the control: stock shifts an unshifted loss's count


@pytest.mark.parametrize("name", list(MEDIA_SAMPLE))
def test_a_sample_of_the_non_text_zoo_is_exact_or_warned(name):
    outcome = check_model(ZOO[name])
    assert (outcome.ours, outcome.stock) == MEDIA_SAMPLE[name], outcome
    assert outcome.reference == ("micro-batches" if name in PER_MICRO_BATCH else "one forward"), outcome


@pytest.mark.parametrize(("name", "kind"), list(COUPLED_SAMPLE))
def test_batch_coupled_losses_of_the_zoo_are_exact_or_warned(name, kind):
    outcome = check_model(ZooModel(name, kind, ZOO[name].config_class))
    assert outcome.ours == COUPLED_SAMPLE[(name, kind)], outcome
    assert outcome.stock in ("silent", "crash"), outcome


@pytest.mark.full  # the whole zoo: 15 to 35 minutes on 2 cores (or python -m benchmarks.zoo --shard i/12)
def test_the_whole_zoo_has_no_silent_difference_and_no_crash():
    outcomes = [check_model(model) for model in zoo_models()]  # and the MoE LMs again with their router loss
    bad = [outcome for outcome in outcomes if outcome.ours in ("silent", "crash")]
    assert not bad, report(outcomes)


# ---- An unshifted standalone decoder, under every topology -------------------------------------------------------


def bart_decoder(seed: int) -> BartForCausalLM:
    torch.manual_seed(seed)
    return BartForCausalLM(tiny(BartConfig))


BART_DECODER = Case("bart_causal_lm_unshifted", bart_decoder, lm_rows)
BART_DECODER_SMOOTHING = Case("bart_causal_lm_unshifted_smoothing", bart_decoder, lm_rows, label_smoothing=0.1)
TOPOLOGIES = (
    Topology("single 2B", per_device=TRAIN_ROWS),
    Topology("grad-accum 2", per_device=TRAIN_ROWS // 2, accumulation=2),
    Topology("DP 2", per_device=TRAIN_ROWS // 2, dp_devices=2),
)


@functools.cache  # pure, and compared with by several tests
def reference(case: Case) -> tuple[float, dict]:
    """The model's own loss on all rows in one forward (label smoothing: transformers' LabelSmoother, unshifted as
    the model's loss is), and its gradient."""
    model = case.build(0)
    batch = default_data_collator(case.rows(TRAIN_ROWS, 1))
    if case.label_smoothing:
        labels = batch.pop("labels")
        loss = LabelSmoother(epsilon=case.label_smoothing)(model(**batch), labels)
    else:
        loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("evaluate_first", [True, False], ids=["checked in evaluation", "checked in training"])
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=[t.name for t in TOPOLOGIES])
@pytest.mark.parametrize("case", [BART_DECODER, BART_DECODER_SMOOTHING], ids=lambda case: case.name)
def test_unshifted_decoder_is_exact(case, topology, evaluate_first, hf_parallel_log):
    # Checked in training, the check of the first micro-batch switches the head before the step is counted.
    loss, grads = reference(case)
    result = run_case(case, topology, evaluate_first=evaluate_first, eval_rows=7 if evaluate_first else 0)
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL
    assert "exact_loss" not in hf_parallel_log.text  # a switch of head is no fallback: no warning


def test_stock_trains_the_unshifted_decoder_on_another_loss():
    # The control: stock's count (and, with smoothing, its loss) is shifted for a class in the causal LM mapping.
    loss, _ = reference(BART_DECODER_SMOOTHING)
    result = run_case(BART_DECODER_SMOOTHING, TOPOLOGIES[1], stock=True, eval_rows=0)
    assert result.loss != pytest.approx(loss, rel=1e-3)


DDP_TOPOLOGY = Topology("DDP 2", per_device=TRAIN_ROWS // 2, processes=2)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> dict:
    """The DDP runs of this file (the unshifted decoder, FSMT), each checked in training and in evaluation, in one
    spawn of 2 CPU ranks (each spawn costs seconds of imports): run name -> result."""
    checks = {"checked in training": {"evaluate_first": False, "eval_rows": 0}, "checked in evaluation": {}}
    runs = {
        f"{case.name}, {checked}": (case, DDP_TOPOLOGY, False, overrides)
        for case in (BART_DECODER, FSMT)
        for checked, overrides in checks.items()
    }
    return run_ddp_runs(runs, tmp_path_factory.mktemp("zoo_ddp"))


def assert_ddp_exact(case: Case, expected: tuple[float, dict], ddp_results: dict) -> None:
    """`case` on 2 DDP ranks, its head checked in training and in evaluation: exact against `expected` (the model's
    own loss and gradient on all rows), wrapped in DDP, ranks equal."""
    loss, grads = expected
    for checked in ("checked in training", "checked in evaluation"):
        name = f"{case.name}, {checked}"
        result = ddp_results[name]
        assert result.world_size == 2, name
        assert result.parallel_mode == "ParallelMode.DISTRIBUTED", name
        assert result.wrapped == "DistributedDataParallel", name
        assert result.loss == pytest.approx(loss, rel=TOL), name
        assert max_relative_diff(result.grads, grads) < TOL, name
        assert result.max_rank_param_diff == 0.0, name


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~8-11 s): .ci/run runs the full step
def test_ddp_ranks_agree_on_the_head_and_stay_exact(ddp_results):
    assert_ddp_exact(BART_DECODER, reference(BART_DECODER), ddp_results)


def test_candidates_toggle_the_shift_of_a_per_position_head_only():
    candidates = candidate_heads(CrossEntropyHead(name="causal_lm", shift=True, per_position=True))
    assert [head.shift for head in candidates] == [True, False]
    assert len(candidate_heads(CrossEntropyHead(name="sequence_classification/single_label"))) == 1


# ---- Decoder inputs ---------------------------------------------------------------------------------------------


def _blenderbot(**config) -> BlenderbotForConditionalGeneration:
    torch.manual_seed(0)
    return BlenderbotForConditionalGeneration(tiny(BlenderbotConfig, **{"use_cache": True, **config})).eval()


def test_an_encoder_decoder_without_prepare_decoder_input_ids_keeps_its_labels_in_the_forward():
    # Blenderbot builds its decoder inputs inside its forward only: the labels stay in, it builds them itself.
    model = _blenderbot()
    assert not hasattr(model, "prepare_decoder_input_ids_from_labels")
    head = resolve_head(model)
    assert isinstance(head, LabelsInForwardHead) and not head.builds_decoder_inputs
    result = run_case(Case("blenderbot", lambda seed: _blenderbot(), seq2seq_rows), TOPOLOGIES[2], eval_rows=0)
    model = _blenderbot()
    model.train()
    loss = model(**default_data_collator(seq2seq_rows(TRAIN_ROWS, 1))).loss
    assert result.loss == pytest.approx(loss.item(), rel=TOL)


def _fsmt(seed: int) -> FSMTForConditionalGeneration:
    torch.manual_seed(seed)
    return FSMTForConditionalGeneration(tiny(FSMTConfig, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))


FSMT = Case("fsmt", _fsmt, seq2seq_rows)
FSMT_SMOOTHING = Case("fsmt_smoothing", _fsmt, seq2seq_rows, label_smoothing=0.1)


def _own_inputs_and_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """What the decoder of `model` receives in a forward with the labels and no decoder inputs, and its loss."""
    seen = {}

    def record(module, args, kwargs):
        seen.setdefault("ids", kwargs["input_ids"] if "input_ids" in kwargs else args[0])

    handle = model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    try:
        loss = model(**batch).loss
    finally:
        handle.remove()
    return seen["ids"], loss


def test_fsmt_builds_other_decoder_inputs_than_from_its_labels():
    # The control: FSMT's forward shifts the inputs, not the labels, so decoder inputs built from the labels (what
    # every forward after the check got before the switch) give another loss than the model's (stock's, one device).
    model = _fsmt(0).eval()
    # Without the row that has no targets, whose labels FSMT's shift cannot build decoder inputs from (IndexError).
    batch = default_data_collator(seq2seq_rows(TRAIN_ROWS, 1)[1:])
    own, loss = _own_inputs_and_loss(model, batch)
    built = decoder_input_ids(model, batch["labels"])
    assert batch["labels"].eq(-100).any()  # decoder_input_ids left the ignored positions of the labels as they were
    assert not torch.equal(own, built)
    # An untrained model's loss hardly depends on its decoder inputs (0.07% here), but beyond the tests' tolerance.
    assert model(**batch, decoder_input_ids=built).loss.item() != pytest.approx(loss.item(), rel=TOL)
    watch = watch_decoder(model)
    try:
        model(**batch)
        assert watch.matches(batch["labels"]).item() == 0.0
    finally:
        watch.remove()
    assert not model.get_decoder()._forward_pre_hooks  # removed


def test_a_normal_seq2seq_builds_its_decoder_inputs_from_its_labels():
    model = CASES["bart_seq2seq"].build(0).eval()
    batch = default_data_collator(CASES["bart_seq2seq"].rows(TRAIN_ROWS, 1))
    own, _ = _own_inputs_and_loss(model, batch)
    assert torch.equal(own, decoder_input_ids(model, batch["labels"]))
    watch = watch_decoder(model)
    try:
        model(**batch)
        assert watch.matches(batch["labels"]).item() == 1.0
    finally:
        watch.remove()


@functools.cache  # pure, and compared with by several tests
def fsmt_reference(case: Case) -> tuple[float, dict]:
    """FSMT's own loss on all rows in one forward, `model(input_ids, attention_mask, labels)` (label smoothing:
    transformers' LabelSmoother on its logits), and its gradient."""
    model = case.build(0)
    batch = default_data_collator(case.rows(TRAIN_ROWS, 1))
    outputs = model(**batch)
    loss = (
        LabelSmoother(epsilon=case.label_smoothing)(outputs, batch["labels"]) if case.label_smoothing else outputs.loss
    )
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _trained_head(result: dict):
    trainer = result.trainer
    return trainer.exact.head(trainer.model)


@pytest.mark.parametrize("evaluate_first", [True, False], ids=["checked in evaluation", "checked in training"])
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=[t.name for t in TOPOLOGIES])
def test_fsmt_is_exact_with_its_labels_in_the_forward(topology, evaluate_first, hf_parallel_log):
    # Checked in training, the check is the first micro-batch (with the labels): the later ones switch.
    loss, grads = fsmt_reference(FSMT)
    result = run_case(FSMT, topology, evaluate_first=evaluate_first, eval_rows=7 if evaluate_first else 0)
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL
    head = _trained_head(result)
    assert isinstance(head, LabelsInForwardHead) and not head.builds_decoder_inputs
    assert head.name == "seq2seq_lm/labels_in_forward"
    assert "exact_loss" not in hf_parallel_log.text  # a switch of head is no fallback: no warning


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~8-11 s): .ci/run runs the full step
def test_ddp_ranks_switch_fsmt_alike_and_stay_exact(ddp_results):
    assert_ddp_exact(FSMT, fsmt_reference(FSMT), ddp_results)


def test_fsmt_keeps_the_label_smoothing_of_its_head():
    loss, grads = fsmt_reference(FSMT_SMOOTHING)
    result = run_case(FSMT_SMOOTHING, TOPOLOGIES[1], evaluate_first=False, eval_rows=0)
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL
    head = _trained_head(result)
    assert isinstance(head, LabelsInForwardHead) and head.smoothing == 0.1 and head.per_position


def test_a_normal_seq2seq_keeps_its_head_after_the_check():
    result = run_case("bart_seq2seq", TOPOLOGIES[1], evaluate_first=False, eval_rows=0)
    head = _trained_head(result)
    assert head.builds_decoder_inputs and not isinstance(head, LabelsInForwardHead)
    assert head.name == "seq2seq_lm"
