"""
Context parallelism (accelerate's `cp_size`, torch's ring attention over FSDP2) stays on the stock loss, warned: its
ranks split each row along the sequence, and it cannot run on CPU ranks for a causal mask (torch registers no CPU
sharding rule for SDPA's flash kernel; pytorch #147793), so it is checked on two GPUs only: hf_parallel warns, naming
context parallelism, and trains at stock's numbers (a fallback never further from one device than stock). Prepared
without a GPU at hand: it runs where two GPUs are (`python -m benchmarks.gpu_check` runs the `multi_gpu` tests).
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers

from tests.helpers.harness import SGD_STEP, Capture, record_hf_parallel_log
from tests.helpers.heads import llama, lm_rows
from tests.helpers.paths import ROOT, repo_env
from tests.helpers.processes import free_port, run_together
from tests.helpers.tiny import ListDataset

LAUNCH_DEADLINE_S = 420


def _train(stock: bool, output_dir: str) -> dict:
    from accelerate.parallelism_config import ParallelismConfig

    import hf_parallel

    trainer_cls, args_cls = (
        (transformers.Trainer, transformers.TrainingArguments)
        if stock
        else (hf_parallel.Trainer, hf_parallel.TrainingArguments)
    )
    arguments = {
        **SGD_STEP,
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "train_sampling_strategy": "sequential",
        "report_to": "none",
        "save_strategy": "no",
        "fsdp": "full_shard",
        "fsdp_config": {"version": 2},
        "parallelism_config": ParallelismConfig(cp_size=2),
    }
    capture = Capture()
    with record_hf_parallel_log() as log:
        trainer = trainer_cls(
            model=llama(0),  # SDPA attention, as context parallelism needs
            args=args_cls(output_dir=output_dir, **arguments),
            train_dataset=ListDataset(lm_rows(8, 1)),
            callbacks=[capture],
        )
        trainer.train()
    return {"losses": capture.losses, "warnings": log.messages, "cp_size": trainer.get_cp_size()}


def main(out_dir: str) -> None:
    """Both Trainers under context parallelism on this process's GPU; rank 0 writes `results.pt` to `out_dir`."""
    from accelerate.state import AcceleratorState

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, stock in (("hf_parallel", False), ("stock", True)):
            results[name] = _train(stock, os.path.join(tmp, name))
            AcceleratorState._reset_state()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multi_gpu
def test_context_parallelism_is_a_warned_fallback_at_stocks_numbers(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    command += [str(free_port()), "-m", "tests.test_context_parallel", str(tmp_path)]
    env = repo_env()
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    run_together([command], ROOT, env, deadline_s=LAUNCH_DEADLINE_S)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    ours, stock = results["hf_parallel"], results["stock"]
    assert ours["cp_size"] == 2 and len(ours["losses"]) == 2, ours
    assert any("context" in message and "parallelism" in message for message in ours["warnings"]), ours["warnings"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(stock["losses"]), rtol=1e-6, atol=0)


if __name__ == "__main__":
    main(*sys.argv[1:])
