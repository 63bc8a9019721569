"""
The fused-loss stand-in (tests/helpers/fused.py) against the real thing's known answer: the unpatched model's own loss
and gradients, on a tiny Llama with uneven valid tokens; the full logits are never built in training; under torch's own
DataParallel (emulated) each replica runs the fused path on itself, and the replicas' losses add up to one device's.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_parallel.testing import simulate_data_parallel
from tests.helpers.fused import FusedCall, fuse_loss, fused_forward
from tests.helpers.tiny import tiny

VOCAB, ROWS, SEQ, HIDDEN = 1000, 3, 24, 32
CHUNK = 33  # rows per chunk: does not divide ROWS * SEQ (the last chunk is short), more than HIDDEN
TOLERANCE = 1e-6


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    sizes = dict(intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config = tiny(
        LlamaConfig, vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=64, use_cache=True, **sizes
    )
    return LlamaForCausalLM(config)


def _batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.tensor([SEQ, 5, 17])  # uneven valid tokens per row
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _valid_targets(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def _loss_and_grads(model, **inputs) -> tuple[torch.Tensor, dict, object]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_same(loss, grads, ref_loss, ref_grads):
    assert _relative(loss, ref_loss) <= TOLERANCE, (float(loss), float(ref_loss))
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert _relative(grads[name], ref_grads[name]) <= TOLERANCE, name


def _pair():
    reference = _tiny_llama()
    fused = copy.deepcopy(reference)
    record = fuse_loss(fused, chunk_size=CHUNK)
    reference.train()
    fused.train()
    return reference, fused, record


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()


COUNTS = {
    "mean": lambda labels: {},
    "num_items_tensor": lambda labels: {"num_items_in_batch": torch.tensor(_valid_targets(labels) + 4)},
    "num_items_int": lambda labels: {"num_items_in_batch": _valid_targets(labels) + 4},
}


class _VocabRows(TorchDispatchMode):
    """The largest number of rows of any tensor an op makes whose last dimension is the vocabulary (logits)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == VOCAB:
                self.most = max(self.most, tensor.numel() // VOCAB)
        return out


@pytest.mark.parametrize("shift", [False, True], ids=["labels", "shift_labels"])
@pytest.mark.parametrize("count", list(COUNTS))
def test_fused_loss_and_gradients_equal_the_models_own(count, shift):
    reference, fused, record = _pair()
    batch = _batch()
    extra = COUNTS[count](batch["labels"])
    ref_batch = batch
    if shift:
        # Targets that are not the shifted labels (the last valid one of each row dropped), so that a forward that
        # ignored shift_labels would differ. The stock forward computes a loss only when given labels too.
        shift_labels = _shifted(batch["labels"])
        shift_labels[torch.arange(ROWS), (shift_labels != -100).sum(1) - 1] = -100
        batch = {**batch, "labels": None, "shift_labels": shift_labels}
        ref_batch = {**batch, "labels": ref_batch["labels"]}
    ref_loss, ref_grads, ref_out = _loss_and_grads(reference, **ref_batch, **extra)
    loss, grads, out = _loss_and_grads(fused, **batch, **extra)
    _assert_same(loss, grads, ref_loss, ref_grads)
    assert ref_out.logits is not None and out.logits is None  # training with labels: no logits
    assert (record.fused_calls, record.logits_calls) == (1, 0)
    assert record.calls == [FusedCall(fused=True, rows=ROWS, replica=False)]


OTHERS = {
    # GPT-2: the base model is `transformer` (found by get_decoder()), the LM head tied to the embedding; no dropout,
    # so that the two forwards are the same computation.
    "gpt2_tied": lambda: GPT2LMHeadModel(
        tiny(GPT2Config, vocab_size=VOCAB, n_embd=HIDDEN, n_positions=1024, use_cache=True)
    ),
    "qwen2": lambda: Qwen2ForCausalLM(
        tiny(
            Qwen2Config,
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            use_cache=True,
        )
    ),
}


@pytest.mark.parametrize("name", list(OTHERS))
def test_other_causal_lms_equal_their_own_loss(name):
    torch.manual_seed(0)
    reference = OTHERS[name]()
    fused = copy.deepcopy(reference)
    record = fuse_loss(fused, chunk_size=CHUNK)
    batch = _batch()
    n = torch.tensor(_valid_targets(batch["labels"]))
    ref_loss, ref_grads, _ = _loss_and_grads(reference.train(), **batch, num_items_in_batch=n)
    loss, grads, out = _loss_and_grads(fused.train(), **batch, num_items_in_batch=n)
    _assert_same(loss, grads, ref_loss, ref_grads)
    assert out.logits is None and (record.fused_calls, record.logits_calls) == (1, 0)


def test_no_op_makes_more_than_one_chunk_of_logits_in_forward_or_backward():
    reference, fused, _ = _pair()
    batch = _batch()
    for model, expected in ((fused, CHUNK), (reference, ROWS * SEQ)):  # the unpatched model is the control
        with _VocabRows() as seen:
            model(**batch).loss.backward()
        assert seen.most == expected, type(model).forward


def test_the_mean_is_over_shifted_valid_targets_and_num_items_divides_the_sum():
    _, fused, _ = _pair()
    batch = _batch()
    n = _valid_targets(batch["labels"])
    with torch.no_grad():
        mean = fused(**batch, skip_logits=True).loss
        summed = fused(**batch, skip_logits=True, num_items_in_batch=1).loss
    assert abs(float(summed) / n - float(mean)) <= TOLERANCE * float(mean)


def test_eval_builds_logits_with_the_models_own_loss_and_skip_logits_forces_the_fused_path():
    reference, fused, record = _pair()
    reference.eval()
    fused.eval()
    batch = _batch()
    with torch.no_grad():
        ref = reference(**batch)
        out = fused(**batch)
        assert out.logits is not None and torch.equal(out.logits, ref.logits)
        assert float(out.loss) == float(ref.loss)
        assert (record.fused_calls, record.logits_calls) == (0, 1)
        skipped = fused(**batch, skip_logits=True)
    assert skipped.logits is None and _relative(skipped.loss, ref.loss) <= TOLERANCE
    assert (record.fused_calls, record.logits_calls) == (1, 1)


def test_training_without_labels_builds_logits_and_skip_logits_without_labels_is_an_error():
    reference, fused, record = _pair()
    batch = _batch()
    labels = batch.pop("labels")
    out = fused(**batch)
    assert out.loss is None and torch.allclose(out.logits, reference(**batch).logits)
    assert (record.fused_calls, record.logits_calls) == (0, 1)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        fused(**batch, skip_logits=True)
    assert fused(**batch, labels=labels, skip_logits=False).logits is not None


@pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0")
def test_under_data_parallel_each_replica_runs_the_fused_path_on_itself():
    reference, fused, record = _pair()
    batch = _batch()
    n = _valid_targets(batch["labels"])
    ref_loss, ref_grads, _ = _loss_and_grads(reference, **batch, num_items_in_batch=n)
    fused.zero_grad(set_to_none=True)
    with simulate_data_parallel(2) as emulation:
        # an int count is replicated to every replica (a 0-dim tensor cannot be scattered)
        losses = torch.nn.DataParallel(fused)(**batch, num_items_in_batch=n).loss
        losses.sum().backward()
    assert emulation.chunk_sizes[0] == [2, 1]
    assert losses.shape == (2,)
    grads = {name: p.grad for name, p in fused.named_parameters()}
    _assert_same(losses.sum().detach(), grads, ref_loss, ref_grads)
    assert sorted(record.calls, key=lambda call: call.rows) == [
        FusedCall(fused=True, rows=1, replica=True),
        FusedCall(fused=True, rows=2, replica=True),
    ]


@pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0")
def test_control_a_forward_bound_to_the_instance_runs_the_original_module_in_every_replica():
    # Liger's patch (`MethodType(forward, model)`) without the re-binding: the check above would catch it.
    _, fused, record = _pair()
    del fused._replicate_for_data_parallel
    fused.forward = types.MethodType(fused_forward, fused)
    batch = _batch()
    with simulate_data_parallel(2):
        torch.nn.DataParallel(fused)(**batch, num_items_in_batch=_valid_targets(batch["labels"]))
    assert {call.replica for call in record.calls} == {False}
    assert record.fused_calls == 2
