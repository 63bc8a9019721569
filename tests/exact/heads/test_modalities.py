"""
Exact beyond text: a sample of each head family (tests/helpers/modalities.py: image classification, CTC "mean" and
"sum", speech seq2seq, semantic segmentation, a vision-language LM) equals the model's own loss and gradient on the
whole step in one process, under gradient accumulation, torch's DataParallel (the emulation, even and with `gpu0_bsz`)
and 2-rank DDP, in training and evaluation; stock is the control that must differ (x2 for the heads that average their
own loss and take `**kwargs`), or, for CTC's summed loss, the fallback must not move away from it. Then the edges:
losses that are not a sum over items are warned with their reason, a head that cannot be computed from the outputs only
fails the check, batch normalisation is warned, the model's `loss_function` is given back.
"""

from __future__ import annotations

import types

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.data.data_collator import default_data_collator
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_parallel
from hf_parallel.exact import resolve_head
from hf_parallel.exact.heads.base import LOSS_CALL_KEY, LossCallWatch
from hf_parallel.exact.heads.ctc import CTCHead
from hf_parallel.exact.resolve import UnsupportedHead
from hf_parallel.fallback import sums_its_loss
from tests.helpers.harness import (
    DDP2,
    DDP2_GA2,
    DP2,
    DP3_GPU0,
    GA2,
    SINGLE,
    TRAIN_ROWS,
    OneProcess,
    assert_equivalent,
    exact_loop_step,
    max_relative_diff,
    own_step,
    record_hf_parallel_log,
    run_case,
    run_ddp_runs,
)
from tests.helpers.modalities import CASES, _omniasr, _segformer, _wav2vec2, ctc_rows, omniasr_rows
from tests.helpers.tiny import tiny

TOL = 1e-5
# Stock's loss under gradient accumulation 2, over one device's: x2 where the model averages its own loss and its
# forward takes **kwargs (stock then neither divides by the accumulation steps nor sees the count ignored); exact for
# a summed CTC loss, which nothing divides; LLaVA's loss honours the count.
STOCK_GA2 = {
    "vit_image_classification": 1.0,
    "wav2vec2_ctc_mean": 2.0,
    "wav2vec2_ctc_sum": 1.0,
    "omniasr_ctc_sum": 1.0,
    "whisper_speech_seq2seq": 2.0,
    "segformer_segmentation": 2.0,
    "llava_vlm": 1.0,
}

single = OneProcess(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_is_the_models_own_loss_on_the_whole_step(case):
    loss, grads = own_step(CASES[case], CASES[case].rows(TRAIN_ROWS, 1))
    result = single(case)
    assert result.loss == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(result.grads, grads) < TOL


IN_PROCESS = [
    pytest.param(case, topology, id=f"{case}-{topology.name}") for topology in (GA2, DP2, DP3_GPU0) for case in CASES
]


@pytest.mark.parametrize(("case", "topology"), IN_PROCESS)
def test_in_process_topologies_equal_one_process(case, topology):
    result = run_case(CASES[case], topology)
    assert_equivalent(result, single(case), f"{case} under {topology.name}", TOL)


def test_control_stock_data_parallel_records_hidden_states_once_per_replica():
    """
    Stock's torch DataParallel on a model whose first forward runs in the replicas: each replica thread installs
    transformers' output-recording hooks into the dictionaries they share with the model, so Segformer's decode head
    gets every hidden state twice and fails (hf_parallel installs them once before replicating: the DP rows above).
    A tripwire: when this stops failing, stock records them once.
    """
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        run_case(CASES["segformer_segmentation"], DP2, stock=True, eval_rows=0)


@pytest.mark.parametrize("case", list(CASES))
def test_control_stock_under_gradient_accumulation(case):
    stock = run_case(CASES[case], GA2, stock=True)
    ratio = STOCK_GA2[case]
    # x2 up to how unevenly the micro-batches' means weigh their items (Whisper's rows: 0.05 %).
    assert stock.loss / single(case).loss == pytest.approx(ratio, rel=1e-4 if ratio == 1.0 else 1e-2)
    if ratio != 1.0:
        assert max_relative_diff(stock.grads, single(case).grads) > 0.3


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> dict:
    runs = {f"DDP 2: {case}": (CASES[case], DDP2, False, {}) for case in CASES}
    runs.update({f"DDP 2 x GA 2: {case}": (CASES[case], DDP2_GA2, False, {}) for case in ("wav2vec2_ctc_sum",)})
    runs["stock DDP 2: wav2vec2_ctc_mean"] = (CASES["wav2vec2_ctc_mean"], DDP2, True, {})
    return run_ddp_runs(runs, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_ddp_two_ranks_equal_one_process(ddp_results):
    for name, result in ddp_results.items():
        if name.startswith("stock"):
            continue
        case = name.split(": ")[1]
        assert result.world_size == 2
        assert result.wrapped == "DistributedDataParallel"
        assert result.max_rank_param_diff == 0.0
        assert_equivalent(result, single(case), name, TOL)
    stock = ddp_results["stock DDP 2: wav2vec2_ctc_mean"]
    assert stock.loss / single("wav2vec2_ctc_mean").loss == pytest.approx(2.0, rel=1e-4)


# ---- CTC's summed loss: never divided, whatever the route ---------------------------------------------------------


class OwnComputeLoss(hf_parallel.Trainer):
    """A subclass that overrides compute_loss: hf_parallel leaves the loss to it (the stock loss), with a warning."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_a_summed_ctc_loss_left_to_stock_stays_as_stock():
    """The fallback divides a loss that never reads the count by the accumulation steps; a summed CTC loss is exact
    in stock and must stay so (it was x0.5)."""
    case = CASES["wav2vec2_ctc_sum"]
    assert sums_its_loss(case.build(0))
    with record_hf_parallel_log() as log:
        ours = run_case(case, GA2, classes=(OwnComputeLoss, hf_parallel.TrainingArguments))
    assert "The loss is left to the Trainer" in log.text
    assert ours.loss == pytest.approx(single("wav2vec2_ctc_sum").loss, rel=TOL)
    assert max_relative_diff(ours.grads, single("wav2vec2_ctc_sum").grads) < TOL


def test_ctc_eval_loss_of_a_sum_is_the_sum_over_the_set():
    """eval_loss of a summed CTC loss: the sum over the evaluation set, as one forward over it gives."""
    case = CASES["wav2vec2_ctc_sum"]
    model = case.build(0).eval()
    rows = case.rows(7, 2)  # run_case's evaluation rows
    with torch.no_grad():
        total = model(**default_data_collator(rows)).loss.item()
    result = run_case(case, SINGLE, evaluate_first=True)
    assert result.eval_loss == pytest.approx(total, rel=TOL)


def test_loss_call_watch_gives_the_model_its_loss_function_back():
    model = _wav2vec2("mean", 0)
    before = model.loss_function
    batch = default_data_collator(ctc_rows(3, 1))
    watch = LossCallWatch(model, ("logit_lengths",))
    model(**batch)
    seen = watch.take()
    watch.remove()
    if seen:  # transformers 5.2x: the model passes them to its loss_function
        assert watch.take() == {}  # taken once
    else:  # transformers 5.19 computes its CTC loss inline: the head takes them as the model computes them
        seen = CTCHead.loss_call.inferred(model, batch)
    assert (
        seen["logit_lengths"].tolist()
        == model._get_feat_extract_output_lengths(batch["attention_mask"].sum(-1)).tolist()
    )
    assert model.loss_function is before
    assert "_loss_function" not in vars(model)


@pytest.mark.skipif(not hasattr(transformers, "OmniASRForCTC"), reason="OmniASR came in a later transformers")
def test_ctc_blank_is_the_one_the_model_passes():
    """
    OmniASR passes `blank_token_id` (0) to its loss, and its pad token (1) is a character: the head scores with the
    blank of the call. With the pad token as the blank (what the head took before), the summed loss of these rows is
    another: the control.
    """
    model = _omniasr(0)
    batch = default_data_collator(omniasr_rows(5, 1))
    head = resolve_head(model)
    watch = LossCallWatch(model, head.loss_call.arguments)
    own = model(**batch)
    call = watch.take()
    watch.remove()
    assert call["blank_token_id"] == 0 and head.blank == 1
    sums, _ = head.row_terms(own, {"labels": batch["labels"], LOSS_CALL_KEY: call})
    assert sums.sum().item() == pytest.approx(own.loss.item(), rel=1e-6)
    without = {key: value for key, value in call.items() if key != "blank_token_id"}
    pad_as_blank, _ = head.row_terms(own, {"labels": batch["labels"], LOSS_CALL_KEY: without})
    assert abs(pad_as_blank.sum().item() / own.loss.item() - 1) > 1e-2


# ---- What stays on the stock loss, and why -------------------------------------------------------------------------


def _named(name: str, config) -> torch.nn.Module:
    """A module of class `name` with `config`: resolve_head goes by the class name."""
    module = type(name, (torch.nn.Module,), {})()
    module.config = config
    return module


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("DPTForDepthEstimation", "scale-invariant"),
        ("ViTForMaskedImageModeling", "masked patches"),
        ("Mask2FormerForUniversalSegmentation", "masks"),
        ("Wav2Vec2ForXVector", "additive-margin"),
    ],
)
def test_losses_that_are_not_a_sum_say_why(name, reason):
    with pytest.raises(UnsupportedHead, match=reason):
        resolve_head(_named(name, transformers.PretrainedConfig()))


def test_segmentation_with_an_auxiliary_head_says_how_to_train_exactly():
    model = _named("BeitForSemanticSegmentation", transformers.BeitConfig(use_auxiliary_head=True))
    with pytest.raises(UnsupportedHead, match="use_auxiliary_head=False"):
        resolve_head(model)


def test_batch_normalisation_is_warned():
    """Segformer's decode head normalises over each micro-batch: warned, once, naming the split."""
    from tests.helpers.heads import Case

    with_batch_norm = Case(
        "segformer_batch_norm", lambda seed: _bn_segformer(seed), CASES["segformer_segmentation"].rows
    )
    with record_hf_parallel_log() as log:
        run_case(with_batch_norm, GA2, eval_rows=0)
    warnings = [m for m in log.messages if "batch normalisation" in m]
    assert len(warnings) == 1 and "2 accumulated micro-batches" in warnings[0], log.text
    with record_hf_parallel_log() as log:
        run_case(with_batch_norm, SINGLE, eval_rows=0)
    assert "batch normalisation" not in log.text  # one forward per step: nothing to warn about


def test_the_check_leaves_the_running_statistics_to_the_steps_forwards():
    """The check's forward before the first step (`calibrate_head`) puts the model's buffers back: a batch
    normalisation's running statistics are those of stock's forwards, one per step here, not one more."""
    from tests.helpers.heads import Case

    with_batch_norm = Case(
        "segformer_batch_norm", lambda seed: _bn_segformer(seed), CASES["segformer_segmentation"].rows
    )
    ours, stock = (run_case(with_batch_norm, SINGLE, eval_rows=0, stock=side) for side in (False, True))
    norms = [result.trainer.model.decode_head.batch_norm for result in (ours, stock)]
    assert int(norms[0].num_batches_tracked) == int(norms[1].num_batches_tracked) > 0
    torch.testing.assert_close(norms[0].running_mean, norms[1].running_mean, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(norms[0].running_var, norms[1].running_var, rtol=1e-4, atol=1e-6)


def _bn_segformer(seed: int) -> torch.nn.Module:
    model = _segformer(seed)
    model.decode_head.batch_norm = torch.nn.BatchNorm2d(model.config.decoder_hidden_size)
    return model


# ---- A head that cannot be computed from the outputs: the check rules it out ---------------------------------------


class _PrefixedLlama(LlamaForCausalLM):
    """Logits with a position more than the labels (a learned prefix, as BLIP-2's queries), its loss on the rest."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = super().forward(input_ids=input_ids, attention_mask=attention_mask)
        logits = torch.cat([outputs.logits[:, :1], outputs.logits], dim=1)
        loss = None
        if labels is not None:
            shown = logits[:, 1:].contiguous()
            loss = self.loss_function(logits=shown, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_logits_longer_than_the_labels_fall_back_with_the_reason_not_a_crash():
    from tests.helpers.heads import Case, lm_rows

    cls = types.new_class("LlamaForCausalLM", (_PrefixedLlama,))  # resolved by its class name: a causal LM

    def build(seed):
        torch.manual_seed(seed)
        return cls(tiny(LlamaConfig))

    with record_hf_parallel_log() as log:
        result = run_case(Case("prefixed", build, lm_rows), GA2, eval_rows=0)
    assert "positions" in log.text and "The loss is left to the Trainer" in log.text, log.text
    assert result.loss is not None and torch.isfinite(torch.tensor(result.loss))


@pytest.mark.parametrize("case", ["wav2vec2_ctc_mean", "wav2vec2_ctc_sum", "segformer_segmentation"])
def test_a_hand_written_loop_is_exact(case):
    """ExactLoop without an accelerator, 2 micro-batches of uneven rows: the step's loss and gradient."""
    rows = CASES[case].rows(TRAIN_ROWS, 1)
    loss, reference = own_step(CASES[case], rows)
    logged, grads = exact_loop_step(CASES[case], rows)
    assert logged == pytest.approx(loss, rel=TOL)
    assert max_relative_diff(grads, reference) < TOL
