"""
The exact loss inside DataParallel replicas (hf_parallel/exact/replicas.py, hf_parallel/data_parallel/replicas.py,
hf_parallel/data_parallel/replication.py),
through the emulation of torch's DataParallel: what travels to device 0, mixed precision in the replica threads, tied
and unused parameters, buffers when GPU 0 gets no rows, models that read their own device.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import hf_parallel
from hf_parallel import BalancedDataParallel
from hf_parallel.data_parallel.chunking import torch_chunk_sizes
from hf_parallel.data_parallel.replicas import ReplicaStep, replica_autocast
from hf_parallel.exact.replicas import takes_use_cache, without_cache
from hf_parallel.testing import simulate_data_parallel
from tests.helpers.harness import SINGLE, TRAIN_ROWS, RunResult, Topology, max_relative_diff, run_case
from tests.helpers.heads import CASES, SEQ, Case, llama, lm_rows, seq2seq_rows
from tests.helpers.tiny import tiny

WIDE_VOCAB = 1000  # logits of 8 rows x 8 positions: 256,000 bytes in fp32
DP2 = Topology("DP 2 devices", per_device=TRAIN_ROWS // 2, dp_devices=2)


def _wide_llama(seed: int):
    return llama(seed, vocab_size=WIDE_VOCAB, use_cache=True)


WIDE_LM = Case("llama_wide_vocab", _wide_llama, lm_rows)


# The DataParallel topologies whose replicas compute the loss: even, GPU 0 without rows, GPU 0 with fewer rows.
DP3_EMPTY_GPU0 = Topology("DP 3 gpu0_bsz=0", per_device=3, dp_devices=3, gpu0_bsz=0)
DP3_BALANCED = Topology("DP 3 gpu0_bsz=1", per_device=3, dp_devices=3, gpu0_bsz=1)
REPLICA_TOPOLOGIES = (DP2, DP3_EMPTY_GPU0, DP3_BALANCED)
TOPOLOGY_IDS = [t.name for t in REPLICA_TOPOLOGIES]


_one_device: dict[tuple, RunResult] = {}


def one_device(case: Case, **overrides) -> RunResult:
    """The one-device run of `case` (cached: several tests compare with the same one)."""
    key = (case.name, tuple(sorted(overrides.items())))
    if key not in _one_device:
        _one_device[key] = run_case(case, SINGLE, **overrides)
    return _one_device[key]


def _stock(topology: Topology) -> Topology:
    """The topology for stock transformers, which has no gpu0_bsz: torch's even split on the same devices."""
    return dataclasses.replace(topology, gpu0_bsz=None)


@pytest.mark.parametrize("topology", REPLICA_TOPOLOGIES, ids=TOPOLOGY_IDS)
def test_training_brings_loss_terms_not_logits_to_device_0(topology):
    logits_bytes = TRAIN_ROWS * SEQ * WIDE_VOCAB * 4
    reference = one_device(WIDE_LM, eval_rows=0)
    exact = run_case(WIDE_LM, topology, eval_rows=0)
    wrapper = "BalancedDataParallel" if topology.gpu0_bsz is not None else "ExactDataParallel"
    assert exact.wrapped == wrapper
    # hf_parallel: one loss sum and one item count per row, the balanced split included; stock: the whole batch's
    # logits (and the loss vector).
    exact_bytes = sum(exact.emulation.gathered_bytes)
    stock_bytes = sum(run_case(WIDE_LM, _stock(topology), stock=True, eval_rows=0).emulation.gathered_bytes)
    assert exact_bytes < 0.01 * logits_bytes, (exact_bytes, logits_bytes)
    assert stock_bytes >= logits_bytes, (stock_bytes, logits_bytes)
    # ... and the step is still the one of one device on the whole batch.
    assert exact.loss == pytest.approx(reference.loss, rel=1e-6)
    assert max_relative_diff(exact.params, reference.params) < 1e-6


def test_evaluation_gathers_logits_only_when_they_are_kept():
    result = run_case(WIDE_LM, DP2, eval_rows=4, evaluate_first=False)
    trainer = result.trainer
    eval_logits_bytes = 4 * SEQ * WIDE_VOCAB * 4
    with simulate_data_parallel(2) as emulation:
        loss_only = trainer.evaluate(trainer.eval_dataset)["eval_loss"]
        loss_only_bytes = sum(emulation.gathered_bytes)
        emulation.gathered_bytes.clear()
        prediction = trainer.predict(trainer.eval_dataset)
        kept_bytes = sum(emulation.gathered_bytes)
    # evaluate() without compute_metrics wants the loss only; predict() keeps the logits.
    assert loss_only_bytes < 0.01 * eval_logits_bytes, (loss_only_bytes, eval_logits_bytes)
    assert kept_bytes >= eval_logits_bytes, (kept_bytes, eval_logits_bytes)
    assert prediction.predictions.shape == (4, SEQ, WIDE_VOCAB)
    assert prediction.metrics["test_loss"] == pytest.approx(loss_only, rel=1e-6)
    reference = run_case(WIDE_LM, SINGLE, eval_rows=4, evaluate_first=False).trainer.predict(trainer.eval_dataset)
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

    overrides = {"bf16": True, **overrides}
    run_case(Case("llama_recorded", build, lm_rows), topology, stock=stock, eval_rows=0, **overrides)
    return record.dtypes


@pytest.mark.parametrize("topology", REPLICA_TOPOLOGIES, ids=TOPOLOGY_IDS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_takes_effect_in_every_replica(topology, precision):
    # hf_parallel: the requested dtype in every replica that runs (torch's replicas have no parameters to read a
    # device from; on a GPU accelerate also keeps its loss scaler for fp16).
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    replicas = 3 if topology.gpu0_bsz == 1 else 2
    # The check of the head (its forward before the step, `calibrate_head`) and the step's forward, in every replica.
    assert _lm_head_dtypes(False, topology, **{"bf16": False, precision: True}) == [dtype] * (2 * replicas)


def test_mixed_precision_of_the_stock_loss_and_the_stock_trainer():
    # The stock loss in hf_parallel (exact_loss=False; without gpu0_bsz, which refuses the stock loss of a model with
    # loss kwargs): bf16 in every replica too.
    dp3 = Topology("DP 3", per_device=3, dp_devices=3)
    assert _lm_head_dtypes(False, dp3, exact_loss=False) == [torch.bfloat16] * len(torch_chunk_sizes(TRAIN_ROWS, 3))
    # Stock under DataParallel: transformers skips accelerate's prepare, so no autocast, fp32 (the trap).
    assert set(_lm_head_dtypes(True, DP2)) == {torch.float32}
    assert set(_lm_head_dtypes(True, DP2, bf16=False, fp16=True)) == {torch.float32}


def test_bf16_replicas_train_as_one_device_in_bf16():
    def bf16_run(topology):
        return run_case(WIDE_LM, topology, eval_rows=0, bf16=True)

    reference = bf16_run(SINGLE)
    for topology in REPLICA_TOPOLOGIES:
        result = bf16_run(topology)
        # The same bf16 forward on other row groupings: equal up to bf16 rounding (8 bits of mantissa).
        assert result.loss == pytest.approx(reference.loss, rel=2e-2), topology.name
        assert max_relative_diff(result.grads, reference.grads) < 5e-2, topology.name


def test_stock_label_smoothing_in_bf16_replicas_shifts_the_targets_as_one_device():
    # The stock loss (exact_loss=False) under DataParallel and bf16 runs the model's forward in bf16 replicas; the
    # label smoother around it shifts a causal LM's targets only if the unwrapped model's class is a causal LM's (it
    # was "ReplicaStep": unshifted targets, x3.22 instead of x2.00 here).
    case = dataclasses.replace(WIDE_LM, name="llama_wide_smoothing", label_smoothing=0.1)
    reference = run_case(case, SINGLE, eval_rows=0, bf16=True, exact_loss=False)
    fp32 = run_case(case, DP2, eval_rows=0, exact_loss=False)  # no autocast to set up: the model's own class
    result = run_case(case, DP2, eval_rows=0, bf16=True, exact_loss=False)
    assert result.wrapped == fp32.wrapped == "DataParallel"
    # Stock multiplies a loss given num_items_in_batch by n_gpu under DataParallel (the x2 of the label-smoothing row
    # of the stock table): the targets are those of one device when the bf16 loss is that factor times its loss.
    assert result.loss == pytest.approx(2 * reference.loss, rel=1e-2)
    assert result.loss == pytest.approx(fp32.loss, rel=1e-2)
    grads = {name: grad / 2 for name, grad in result.grads.items()}
    assert max_relative_diff(grads, reference.grads) < 5e-2


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
            step = ReplicaStep(model, lambda run, inputs, labels: run(**inputs).dtype, (), torch.float16, "cpu")
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
    ReplicaStep(model, lambda run, inputs, labels: run(**inputs), (), torch.float16, "cpu")(input=x)
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
    # The check's forward and the step's, in both replicas, although the config says use_cache=True.
    assert calls == [False] * 4
    assert takes_use_cache(_wide_llama(0)) and not takes_use_cache(torch.nn.Linear(2, 2))


def test_the_cache_does_not_travel():
    model = _wide_llama(0)
    outputs = model(input_ids=torch.randint(0, 50, (2, 5)), use_cache=True)
    assert "cache" in outputs or "past_key_values" in outputs  # its name from transformers 5.2x on, and before
    trimmed = without_cache(outputs)
    assert list(trimmed.keys()) == ["logits"]
    torch.testing.assert_close(trimmed.logits, outputs.logits)


def _batch_norm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_batch_norm_statistics_update_when_gpu0_gets_no_rows():
    model, reference = _batch_norm_model(), _batch_norm_model()
    x = torch.randn(6, 3)
    with simulate_data_parallel(3) as emulation:
        wrapper = BalancedDataParallel(model, gpu0_bsz=0)
        wrapper(x)  # rows [0, 3, 3]: GPU 0's replica does not run
    assert emulation.chunk_sizes[0] == [3, 3] and emulation.replica_devices == [1, 2]
    reference(x[:3])  # nn.DataParallel keeps the statistics of the replica on GPU 0; here the first that ran
    assert model[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)


def test_one_row_of_a_batch_norm_model_is_warned(hf_parallel_log):
    with simulate_data_parallel(3):
        wrapper = BalancedDataParallel(_batch_norm_model(), gpu0_bsz=1)
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            wrapper(torch.randn(7, 3))  # [1, 3, 3]: BatchNorm1d cannot train on GPU 0's one row
        assert "a device gets 1 row of a 7-row batch (split [1, 3, 3]" in hf_parallel_log.text
        hf_parallel_log.records.clear()
        wrapper.eval()
        wrapper(torch.randn(7, 3))  # evaluation uses the running statistics: nothing to warn about
    assert hf_parallel_log.records == []


@pytest.mark.parametrize("gpu0_bsz", [None, 0, 1], ids=["even", "gpu0_bsz=0", "gpu0_bsz=1"])
def test_replica_gradients_equal_one_device(gpu0_bsz):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[0].bias.requires_grad_(False)  # a frozen parameter keeps its plain copy
    x = torch.randn(7, 3)
    with simulate_data_parallel(3):
        if gpu0_bsz is None:
            wrapper = hf_parallel.ExactDataParallel(model)
        else:
            wrapper = BalancedDataParallel(model, gpu0_bsz=gpu0_bsz)
        wrapper(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert isinstance(model[0].weight, torch.nn.Parameter)  # the module's own parameters are untouched


# ---- Tied parameters, unused parameters, models that read their own device ----


def _t5(seed: int):
    torch.manual_seed(seed)
    config = tiny(T5Config, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=True, use_cache=True)
    return T5ForConditionalGeneration(config)


TIED = {
    "gpt2": CASES["gpt2_causal_lm"],
    "bert_mlm": CASES["bert_masked_lm"],
    "bart": CASES["bart_seq2seq"],
    "t5": Case("t5_seq2seq", _t5, seq2seq_rows),
}


@pytest.mark.parametrize("n_devices", [2, 3, 4])
@pytest.mark.parametrize("model", list(TIED))
def test_tied_weights_with_gpu0_bsz_0_equal_one_device(model, n_devices):
    case = TIED[model]
    built = case.build(0)
    tied = [n for n, p in built.named_parameters(remove_duplicate=False) if p is built.get_input_embeddings().weight]
    assert len(tied) >= 2, tied  # the embedding is tied to the LM head (and to the encoder/decoder embeddings)
    topology = Topology(
        f"DP {n_devices} gpu0_bsz=0", per_device=-(-TRAIN_ROWS // n_devices), dp_devices=n_devices, gpu0_bsz=0
    )
    result = run_case(case, topology, eval_rows=0)
    assert result.emulation.chunk_sizes[0][0] != 0 and 0 not in result.emulation.replica_devices
    reference = one_device(case, eval_rows=0)
    assert result.loss == pytest.approx(reference.loss, rel=1e-5)
    assert max_relative_diff(result.grads, reference.grads) < 1e-5
    assert max_relative_diff(result.params, reference.params) < 1e-5


def _with_unused_layer(seed: int):
    model = CASES["bert_single_label"].build(seed)
    model.unused = torch.nn.Linear(4, 4)  # no row goes through it (an MoE expert nothing was routed to)
    return model


UNUSED = Case("bert_with_unused_layer", _with_unused_layer, CASES["bert_single_label"].rows)
ADAMW = dict(optim="adamw_torch", weight_decay=0.1, learning_rate=0.01)


@pytest.mark.parametrize("topology", REPLICA_TOPOLOGIES, ids=TOPOLOGY_IDS)
def test_a_parameter_no_row_uses_gets_no_gradient(topology):
    initial = dict(_with_unused_layer(0).named_parameters())
    reference = one_device(UNUSED, eval_rows=0, **ADAMW)
    result = run_case(UNUSED, topology, eval_rows=0, **ADAMW)
    # One device: no gradient, so AdamW leaves the layer alone (no decay); the same under DataParallel.
    for name in ("unused.weight", "unused.bias"):
        assert name not in reference.grads and name not in result.grads, name
        assert torch.equal(result.params[name], initial[name]), name
    assert max_relative_diff(result.params, reference.params) < 1e-5
    # Control: torch's own DataParallel (stock) hands it zeros, and AdamW's decay moves it.
    stock = run_case(UNUSED, _stock(topology), stock=True, eval_rows=0, **ADAMW)
    assert torch.equal(stock.grads["unused.weight"], torch.zeros(4, 4))
    assert not torch.equal(stock.params["unused.weight"], initial["unused.weight"])


def _reads_its_device(seed: int):
    # What many transformers forwards do: read `self.device` / `self.dtype` (here in a pre-hook, which runs in each
    # replica with the replica as `module`); they are `next(self.parameters())` underneath.
    model = CASES["bert_single_label"].build(seed)

    def reads(module, args, kwargs):
        kwargs["attention_mask"] = kwargs["attention_mask"].to(module.device, module.dtype)
        return args, kwargs

    model.register_forward_pre_hook(reads, with_kwargs=True)
    return model


READS_DEVICE = Case("bert_reads_its_device", _reads_its_device, CASES["bert_single_label"].rows)


@pytest.mark.parametrize("topology", REPLICA_TOPOLOGIES, ids=TOPOLOGY_IDS)
def test_a_model_that_reads_self_device_trains_in_replicas(topology):
    reference = one_device(READS_DEVICE)
    result = run_case(READS_DEVICE, topology)
    assert result.loss == pytest.approx(reference.loss, rel=1e-5)
    assert result.eval_loss == pytest.approx(reference.eval_loss, rel=1e-5)
    assert max_relative_diff(result.params, reference.params) < 1e-5
    # Control: torch's replicas have no parameters; transformers' `self.device` raises there (stock fails).
    with pytest.raises(StopIteration, match="in replica 0"):
        run_case(READS_DEVICE, _stock(topology), stock=True, eval_rows=0)


def _real_replicas_check(device_ids: list[int], wrapper_class=torch.nn.DataParallel):
    # torch's own nn.DataParallel (scatter, replicate, parallel_apply in threads, gather) running the exact loss in
    # each replica, under bf16: terms equal those of one device, and the replicas computed in bf16.
    from hf_parallel.data_parallel.replicas import run_in_replicas
    from hf_parallel.exact import CrossEntropyHead

    model = _wide_llama(0).cuda()
    dtypes = []
    model.lm_head.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    wrapper = wrapper_class(model, device_ids=device_ids)
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
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper", ["DataParallel", "ExactDataParallel", "BalancedDataParallel"])
def test_real_data_parallel_replicas_on_one_gpu(wrapper):
    _real_replicas_check([0, 0], _WRAPPERS[wrapper])


@pytest.mark.multi_gpu
@pytest.mark.parametrize("wrapper", ["DataParallel", "ExactDataParallel", "BalancedDataParallel"])
def test_real_data_parallel_replicas_on_two_gpus(wrapper):
    _real_replicas_check([0, 1], _WRAPPERS[wrapper])


def _balanced(model, device_ids):
    return BalancedDataParallel(model, device_ids=device_ids, gpu0_bsz=1)


_WRAPPERS = {
    "DataParallel": torch.nn.DataParallel,
    "ExactDataParallel": hf_parallel.ExactDataParallel,
    "BalancedDataParallel": _balanced,
}
