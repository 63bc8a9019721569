"""
The exact loss inside DataParallel replicas (hf_parallel/exact/replicas.py), through the CPU simulation: what travels
to device 0, mixed precision in the replica threads, buffers when GPU 0 gets no rows.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from hf_parallel import BalancedDataParallel
from hf_parallel.exact.replicas import ReplicaStep, replica_autocast, takes_use_cache, without_cache
from hf_parallel.testing import CpuTransport, SimulatedBalancedDataParallel, simulate_data_parallel
from tests.harness import SINGLE, TRAIN_ROWS, Topology, max_relative_diff, run_case
from tests.heads import SEQ, Case, llama, lm_rows

WIDE_VOCAB = 1000  # logits of 8 rows x 8 positions: 256,000 bytes in fp32
DP2 = Topology("DP 2 devices", per_device=TRAIN_ROWS // 2, dp_devices=2)


def _wide_llama(seed: int):
    return llama(seed, vocab_size=WIDE_VOCAB, use_cache=True)


WIDE_LM = Case("llama_wide_vocab", _wide_llama, lm_rows)


@pytest.fixture
def gathered(monkeypatch):
    """The bytes each simulated DataParallel call brought to device 0, in call order."""
    sizes: list[int] = []
    original = CpuTransport.gather

    def recording(self, outputs, output_device, dim):
        result = original(self, outputs, output_device, dim)
        sizes.append(self.last_gathered_bytes)
        return result

    monkeypatch.setattr(CpuTransport, "gather", recording)
    return sizes


def test_training_brings_loss_terms_not_logits_to_device_0(gathered):
    logits_bytes = TRAIN_ROWS * SEQ * WIDE_VOCAB * 4
    reference = run_case(WIDE_LM, SINGLE, eval_rows=0)
    exact = run_case(WIDE_LM, DP2, eval_rows=0)
    assert exact["wrapped"] == "SimulatedDataParallel"
    (exact_bytes,) = gathered  # one step, one forward
    gathered.clear()
    run_case(WIDE_LM, DP2, stock=True, eval_rows=0)
    (stock_bytes,) = gathered
    # hf_parallel: one loss sum and one item count per row; stock: the whole batch's logits (and the loss vector).
    assert exact_bytes < 0.01 * logits_bytes, (exact_bytes, logits_bytes)
    assert stock_bytes >= logits_bytes, (stock_bytes, logits_bytes)
    # ... and the step is still the one of one device on the whole batch.
    assert exact["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert max_relative_diff(exact["params"], reference["params"]) < 1e-6


def test_evaluation_gathers_logits_only_when_they_are_kept(gathered):
    result = run_case(WIDE_LM, DP2, eval_rows=4, evaluate_first=False)
    trainer = result["trainer"]
    eval_logits_bytes = 4 * SEQ * WIDE_VOCAB * 4
    with simulate_data_parallel(2):
        gathered.clear()
        loss_only = trainer.evaluate(trainer.eval_dataset)["eval_loss"]
        loss_only_bytes = sum(gathered)
        gathered.clear()
        prediction = trainer.predict(trainer.eval_dataset)
        kept_bytes = sum(gathered)
    # evaluate() without compute_metrics wants the loss only; predict() keeps the logits.
    assert loss_only_bytes < 0.01 * eval_logits_bytes, (loss_only_bytes, eval_logits_bytes)
    assert kept_bytes >= eval_logits_bytes, (kept_bytes, eval_logits_bytes)
    assert prediction.predictions.shape == (4, SEQ, WIDE_VOCAB)
    assert prediction.metrics["test_loss"] == pytest.approx(loss_only, rel=1e-6)
    reference = run_case(WIDE_LM, SINGLE, eval_rows=4, evaluate_first=False)["trainer"].predict(trainer.eval_dataset)
    assert prediction.metrics["test_loss"] == pytest.approx(reference.metrics["test_loss"], rel=1e-6)
    torch.testing.assert_close(
        torch.as_tensor(prediction.predictions), torch.as_tensor(reference.predictions), rtol=1e-5, atol=1e-5
    )


class _OutputDtypes:
    """The dtype of every `lm_head` output, as a forward hook sees it (inside each replica)."""

    def __init__(self):
        self.dtypes: list[torch.dtype] = []

    def __call__(self, module, args, output):
        self.dtypes.append(output.dtype)


def _lm_head_dtypes(stock: bool, topology: Topology, **overrides) -> list[torch.dtype]:
    record = _OutputDtypes()

    def build(seed: int):
        model = _wide_llama(seed)
        model.lm_head.register_forward_hook(record)
        return model

    run_case(Case("llama_recorded", build, lm_rows), topology, stock=stock, eval_rows=0, bf16=True, **overrides)
    return record.dtypes


def test_bf16_takes_effect_in_every_replica():
    # One device: accelerate's autocast makes the lm_head compute in bf16.
    assert set(_lm_head_dtypes(False, SINGLE)) == {torch.bfloat16}
    # Stock under DataParallel: transformers skips accelerate's prepare, so no autocast, fp32 (the trap).
    assert set(_lm_head_dtypes(True, DP2)) == {torch.float32}
    exact = _lm_head_dtypes(False, DP2)
    assert exact == [torch.bfloat16, torch.bfloat16]  # both replicas
    assert set(_lm_head_dtypes(False, DP2, exact_loss=False)) == {torch.bfloat16}  # the stock loss too


def test_a_replica_thread_gets_the_requested_dtype_not_the_thread_default():
    # torch's parallel_apply enters `autocast(device, enabled=...)` in each replica thread: the dtype is then the
    # thread's default (fp16 on CUDA, bf16 on CPU), not the caller's. ReplicaStep sets it in the thread.
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    seen = {}

    def in_thread():
        with torch.autocast("cpu", enabled=True):  # what parallel_apply does
            seen["plain"] = model(x).dtype
        with torch.autocast("cpu", enabled=True):
            step = ReplicaStep(model, lambda run, inputs, labels: run(**inputs).dtype, (), torch.float16)
            seen["replica_step_inner"] = step(input=x)

    with torch.autocast("cpu", dtype=torch.float16):
        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join()
    assert seen["plain"] == torch.bfloat16  # the request for fp16 was lost on the way into the thread
    # ReplicaStep's outputs are converted back to fp32 (as accelerate does); what ran inside was fp16:
    assert seen["replica_step_inner"] == torch.float32
    inner = {}
    model.register_forward_hook(lambda module, args, output: inner.setdefault("dtype", output.dtype))
    ReplicaStep(model, lambda run, inputs, labels: run(**inputs), (), torch.float16)(input=x)
    assert inner["dtype"] == torch.float16


@pytest.mark.parametrize(
    "setting, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None), (None, None)]
)
def test_replica_autocast_follows_accelerate_setting(setting, dtype):
    assert replica_autocast(setting) == dtype


def test_training_forwards_build_no_cache():
    calls = []

    def build(seed: int):
        model = _wide_llama(seed)
        model.model.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(kwargs.get("use_cache")), with_kwargs=True
        )
        return model

    run_case(Case("llama_cache", build, lm_rows), DP2, eval_rows=0)
    assert calls == [False, False]  # both replicas, although the config says use_cache=True
    assert takes_use_cache(_wide_llama(0)) and not takes_use_cache(torch.nn.Linear(2, 2))


def test_the_cache_does_not_travel():
    model = _wide_llama(0)
    outputs = model(input_ids=torch.randint(0, 50, (2, 5)), use_cache=True)
    assert "cache" in outputs
    trimmed = without_cache(outputs)
    assert list(trimmed.keys()) == ["logits"]
    torch.testing.assert_close(trimmed.logits, outputs.logits)


class _CopyingTransport(CpuTransport):
    """Replicas that are copies (as on GPUs, where each device gets its own), for a forward without gradients."""

    def replicate(self, module, device_ids):
        return [copy.deepcopy(module) for _ in device_ids]


def _batch_norm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_batch_norm_statistics_update_when_gpu0_gets_no_rows():
    model, reference = _batch_norm_model(), _batch_norm_model()
    x = torch.randn(6, 3)
    wrapper = BalancedDataParallel(model, gpu0_bsz=0, transport=_CopyingTransport(n_devices=3))
    with torch.no_grad():
        wrapper(x)  # rows [0, 3, 3]: GPU 0's replica does not run
        reference(x[:3])  # nn.DataParallel keeps the statistics of the first replica that ran
    assert model[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)


def test_one_row_of_a_batch_norm_model_is_warned(hf_parallel_log):
    wrapper = SimulatedBalancedDataParallel(_batch_norm_model(), gpu0_bsz=1, n_devices=3)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        wrapper(torch.randn(7, 3))  # [1, 3, 3]: BatchNorm1d cannot train on GPU 0's one row
    assert "a device gets 1 row of a 7-row batch (split [1, 3, 3]" in hf_parallel_log.text
    hf_parallel_log.records.clear()
    wrapper.eval()
    wrapper(torch.randn(7, 3))  # evaluation uses the running statistics: nothing to warn about
    assert hf_parallel_log.records == []


def test_gradients_of_replicas_reach_the_module_when_gpu0_gets_no_rows():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    model[0].bias.requires_grad_(False)  # a frozen parameter keeps its plain copy
    reference[0].bias.requires_grad_(False)
    x = torch.randn(6, 3)
    wrapper = BalancedDataParallel(model, gpu0_bsz=0, transport=_CopyingTransport(n_devices=3))
    wrapper(x).pow(2).sum().backward()  # rows [0, 3, 3]: two replicas that are copies, none on GPU 0
    assert wrapper.transport.last_chunk_sizes == [3, 3]
    reference(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert model[0].bias.grad is None
    assert isinstance(model[0].weight, torch.nn.Parameter)  # the module's own parameters are untouched


def _real_replicas_check(device_ids: list[int]):
    # torch's own nn.DataParallel (scatter, replicate, parallel_apply in threads, gather) running the exact loss in
    # each replica, under bf16: terms equal those of one device, and the replicas computed in bf16.
    from hf_parallel.exact import CrossEntropyHead
    from hf_parallel.exact.replicas import run_in_replicas

    model = _wide_llama(0).cuda()
    dtypes = []
    model.lm_head.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    wrapper = torch.nn.DataParallel(model, device_ids=device_ids)
    head = CrossEntropyHead(shift=True, name="causal_lm")
    ids = torch.randint(0, 50, (6, SEQ), device="cuda")

    def step(run, inputs, labels):
        sums, counts = head.row_terms(run(**inputs), labels)
        return {"sums": sums, "counts": counts}

    terms = run_in_replicas(wrapper, step, {"input_ids": ids}, {"labels": ids.clone()}, torch.bfloat16)
    assert dtypes == [torch.bfloat16] * len(device_ids)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected_sums, expected_counts = head.row_terms(model(input_ids=ids), {"labels": ids.clone()})
    assert terms["sums"].shape == (6, 1) and terms["sums"].device == torch.device("cuda", device_ids[0])
    torch.testing.assert_close(terms["counts"], expected_counts)
    torch.testing.assert_close(terms["sums"], expected_sums.float(), rtol=2e-2, atol=2e-2)
    terms["sums"].sum().backward()
    assert model.lm_head.weight.grad is not None


@pytest.mark.gpu
def test_real_data_parallel_replicas_on_one_gpu():
    _real_replicas_check([0, 0])


@pytest.mark.multi_gpu
def test_real_data_parallel_replicas_on_two_gpus():
    _real_replicas_check([0, 1])
