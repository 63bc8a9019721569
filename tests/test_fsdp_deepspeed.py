"""
FSDP and DeepSpeed ZeRO: they average gradients over the data-parallel ranks as DDP does, so the exact loss scales
each rank's S / C by the number of processes there too. Checked, against one process on the whole batch (logged loss,
parameters after one SGD step, eval_loss), by launching this module as the training script:

    torchrun --nproc_per_node 2 -m tests.test_fsdp_deepspeed fsdp OUT_DIR    # FSDP2 (multi_gpu)
    torchrun --nproc_per_node 2 -m tests.test_fsdp_deepspeed zero2 OUT_DIR   # ZeRO-2, when deepspeed is installed
    CUDA_VISIBLE_DEVICES=0 python -m tests.test_fsdp_deepspeed single OUT_DIR  # the GPU reference
    torchrun --nproc_per_node 2 -m tests.test_fsdp_deepspeed cpu_fsdp OUT_DIR  # fsdp=True with use_cpu: DDP

Without GPUs accelerate does not enable FSDP: `fsdp=True` with `use_cpu` trains with DDP (and is exact; hf_parallel
warns). FSDP2 itself runs on CPU with gloo: tests/test_fsdp2.py checks ExactLoop on a `fully_shard`-ed model and the
Trainer on a model transformers shards at load time, on 2 CPU ranks.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

from hf_parallel import Trainer, TrainingArguments
from hf_parallel.exact import resolve_head
from tests.helpers.harness import (
    SGD_STEP,
    SINGLE,
    TRAIN_ROWS,
    Capture,
    max_relative_diff,
    record_hf_parallel_log,
    run_case,
    training_args,
)
from tests.helpers.heads import CASES
from tests.helpers.paths import NO_GPUS, ROOT, repo_env
from tests.helpers.processes import free_port, run_together

TOL = 1e-5
EVAL_ROWS = 7  # not a multiple of 2 ranks x 2 rows: the distributed evaluation pads with a duplicate

# DeepSpeed ZeRO stage 2 in fp32; "auto" takes the value from TrainingArguments. The Trainer's SGD is a client
# optimizer, which ZeRO accepts only when told to.
ZERO2 = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
}
# name: (processes, per-device rows, TrainingArguments). Every setup trains the same TRAIN_ROWS rows in one step.
SETUPS = {
    "single": (1, TRAIN_ROWS, {"use_cpu": False}),
    "fsdp": (2, TRAIN_ROWS // 2, {"use_cpu": False, "fsdp": True, "fsdp_config": {"version": 2}}),
    "zero2": (2, TRAIN_ROWS // 2, {"use_cpu": False, "deepspeed": ZERO2}),
    "cpu_fsdp": (2, TRAIN_ROWS // 2, {"use_cpu": True, "fsdp": True}),
}
# name: (case, stock). The classifier has an ignored row, the causal LM uneven token counts: a split that averages
# per-rank means shows. Stock multiplies the classifier's own mean by the number of processes: x2.
RUNS = {
    "bert_single_label": ("bert_single_label", False),
    "llama_causal_lm": ("llama_causal_lm", False),
    "stock bert_single_label": ("bert_single_label", True),
}
LAUNCH_DEADLINE_S = 420


# ---- The launched training (each rank runs this module) -------------------------------------------------------------


def _train(case_name: str, stock: bool, per_device: int, arguments: dict, output_dir: str) -> dict:
    """One SGD step of `case_name`, then an evaluation; what the test compares, with the topology it ran under."""
    case = CASES[case_name]
    trainer_cls, args_cls = (
        (transformers.Trainer, transformers.TrainingArguments) if stock else (Trainer, TrainingArguments)
    )
    capture = Capture()
    args = training_args(
        output_dir, args_cls=args_cls, **{**SGD_STEP, "per_device_train_batch_size": per_device, **arguments}
    )
    with record_hf_parallel_log() as log:
        trainer = trainer_cls(
            model=case.build(0), args=args, train_dataset=case.dataset(TRAIN_ROWS, seed=1),
            eval_dataset=case.dataset(EVAL_ROWS, seed=2), callbacks=[capture],
        )  # fmt: skip
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    # The whole model on rank 0 (FSDP gathers its shards there); the names of the parameters of the plain model.
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    names = [name for name, _ in case.build(0).named_parameters()]
    report = {
        "loss": capture.loss,
        "eval_loss": eval_loss,
        "params": {name: state[name].detach().float().cpu() for name in names if name in state},
        "world_size": trainer.args.world_size,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "fsdp": trainer.is_fsdp_enabled,
        "deepspeed": trainer.is_deepspeed_enabled,
        "wrapped": type(trainer.model_wrapped).__name__,
        "fallbacks": [message for message in log.messages if message.startswith("exact_loss:")],
    }
    if report["wrapped"] == "DistributedDataParallel":  # replicated parameters: every rank must hold the same
        flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        report["max_rank_param_diff"] = max((g - flat).abs().max().item() for g in gathered)
    return report


def main(setup: str, out_dir: str) -> None:
    """Every run of `RUNS` under `SETUPS[setup]`; rank 0 writes `results.pt` to `out_dir`."""
    from accelerate.state import AcceleratorState

    processes, per_device, arguments = SETUPS[setup]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (case_name, stock) in RUNS.items():
            results[name] = _train(case_name, stock, per_device, arguments, os.path.join(tmp, name))
            AcceleratorState._reset_state()  # each Trainer builds its own plugins; the process group stays
    assert results[next(iter(RUNS))]["world_size"] == processes, results
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---- The launches ---------------------------------------------------------------------------------------------------


def launch(setup: str, out_dir: Path, **env: str) -> dict:
    """Launch `main(setup, out_dir)` (torchrun for several processes) and return rank 0's results."""
    processes = SETUPS[setup][0]
    module = ["-m", "tests.test_fsdp_deepspeed", setup, str(out_dir)]
    if processes > 1:
        port = str(free_port())
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
        command += ["--master_port", port, *module]
    else:
        command = [sys.executable, *module]
    child_env = repo_env(**env)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        child_env.pop(name, None)
    # Every process's output is shown when one fails or the launch passes its deadline.
    run_together([command], ROOT, child_env, deadline_s=LAUNCH_DEADLINE_S)
    return torch.load(out_dir / "results.pt", weights_only=False)


def assert_exact(result: dict, reference: dict, what: str) -> None:
    assert not result["fallbacks"], f"{what}: fell back to the stock loss: {result['fallbacks']}"
    assert result["loss"] == pytest.approx(reference["loss"], rel=TOL), f"{what}: logged loss"
    assert result["eval_loss"] == pytest.approx(reference["eval_loss"], rel=TOL), f"{what}: eval_loss"
    assert result["params"].keys() == reference["params"].keys(), what
    assert max_relative_diff(result["params"], reference["params"]) < TOL, f"{what}: parameters after the step"


def assert_stock_doubles(result: dict, reference: dict) -> None:
    assert result["loss"] / reference["loss"] == pytest.approx(2.0, rel=1e-3)
    assert max_relative_diff(result["params"], reference["params"]) > 10 * TOL


# ---- On GPUs --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory) -> dict:
    """One process on one GPU with the whole batch: the reference of every GPU launch."""
    return launch("single", tmp_path_factory.mktemp("single"), CUDA_VISIBLE_DEVICES="0")


@pytest.mark.slow
@pytest.mark.multi_gpu
def test_fsdp2_on_two_gpus_equals_one_process(gpu_reference, tmp_path):
    results = launch("fsdp", tmp_path)
    for name, (case, stock) in RUNS.items():
        result = results[name]
        assert result["world_size"] == 2 and result["distributed_type"] == "FSDP" and result["fsdp"], result
        assert result["wrapped"].startswith("FSDP"), result["wrapped"]  # fully_shard's class, FSDP<model class>
        if stock:
            assert_stock_doubles(result, gpu_reference[name.removeprefix("stock ")])
        else:
            assert_exact(result, gpu_reference[name], f"{case} under FSDP2, 2 GPUs")


@pytest.mark.slow
@pytest.mark.multi_gpu
def test_deepspeed_zero2_on_two_gpus_equals_one_process(gpu_reference, tmp_path):
    pytest.importorskip("deepspeed")
    results = launch("zero2", tmp_path)
    for name, (case, stock) in RUNS.items():
        result = results[name]
        assert result["world_size"] == 2 and result["distributed_type"] == "DEEPSPEED" and result["deepspeed"], result
        assert result["wrapped"] == "DeepSpeedEngine", result["wrapped"]
        if stock:
            assert_stock_doubles(result, gpu_reference[name.removeprefix("stock ")])
        else:
            assert_exact(result, gpu_reference[name], f"{case} under DeepSpeed ZeRO-2, 2 GPUs")


# ---- On CPUs --------------------------------------------------------------------------------------------------------


@pytest.mark.full  # 15 s; tests/test_fsdp2.py checks the downgrade warning and FSDP2 itself on CPU ranks
def test_fsdp_with_use_cpu_trains_with_ddp_exactly(tmp_path):
    results = launch("cpu_fsdp", tmp_path, **NO_GPUS)
    # One process's runs, as dicts like the launched ranks' reports (and the GPU reference's).
    references = {case: vars(run_case(case, SINGLE, evaluate_first=False)) for case, _ in RUNS.values()}
    for name, (case, stock) in RUNS.items():
        result = results[name]
        # accelerate enables FSDP for GPUs only: the same arguments train with DDP over gloo.
        assert result["world_size"] == 2 and result["distributed_type"] == "MULTI_CPU", result
        assert not result["fsdp"] and result["wrapped"] == "DistributedDataParallel", result
        assert result["max_rank_param_diff"] == 0.0
        if stock:
            assert_stock_doubles(result, references[case])
        else:
            assert_exact(result, references[case], f"{case}, fsdp=True with use_cpu")


def test_a_model_sharded_by_fsdp2_keeps_its_head():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    model = CASES["bert_single_label"].build(0)
    labels = torch.tensor([0, 1])
    expected = resolve_head(model, ["labels"], sample_labels=labels)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert type(model).__name__ == "FSDPBertForSequenceClassification"
    assert repr(resolve_head(model, ["labels"], sample_labels=labels)) == repr(expected)


if __name__ == "__main__":
    main(*sys.argv[1:])
