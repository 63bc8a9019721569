"""
Run one optimizer step of a head case under a topology and report what an exact loss must keep equal.

A topology is (per-device batch, gradient accumulation, DDP processes, simulated DataParallel devices); every
topology used by the tests sees the same 2B training rows in one optimizer step, so the loss, the gradient and the
parameters after the step must equal those of one process with batch 2B.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers

from hf_parallel import Trainer, TrainingArguments
from hf_parallel.testing import spawn_cpu_ranks as spawn_ranks
from tests.heads import CASES
from tests.tiny import IterableRows

TRAIN_ROWS = 8  # 2B with B = 4
EVAL_ROWS = 7  # not divisible by 2 ranks x 2 rows: DDP evaluation pads with duplicates


@dataclass(frozen=True)
class Topology:
    name: str
    per_device: int
    accumulation: int = 1
    processes: int = 1
    dp_devices: int = 1
    gpu0_bsz: int | None = None


SINGLE = Topology("single 2B", per_device=TRAIN_ROWS)


class Capture(transformers.TrainerCallback):
    """The logged loss and the gradient that the optimizer is about to apply."""

    def __init__(self):
        self.loss = None
        self.losses = []  # every logged training loss, one per logging step
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            if self.loss is None:
                self.loss = logs["loss"]


def make_args(args_cls, output_dir: str, topology: Topology, label_smoothing: float = 0.0, **overrides):
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=topology.per_device,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=topology.accumulation,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # clipping would hide a wrong scale
        weight_decay=0.0,
        logging_steps=1,
        logging_nan_inf_filter=False,
        label_smoothing_factor=label_smoothing,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        include_num_input_tokens_seen="no",
    )
    if topology.gpu0_bsz is not None:
        kwargs["gpu0_bsz"] = topology.gpu0_bsz
    kwargs.update(overrides)
    if topology.dp_devices > 1:
        from hf_parallel.testing import simulated_training_args

        return simulated_training_args(topology.dp_devices, args_cls, **kwargs)
    return args_cls(**kwargs)


def run_case(
    case_name: str,
    topology: Topology,
    stock: bool = False,
    exact_loss: bool = True,
    train_rows: int = TRAIN_ROWS,
    evaluate_first: bool = True,
    iterable: bool = False,
    **overrides,
) -> dict:
    """
    Train one step and evaluate; return the logged loss, eval_loss, gradient and parameters.

    `evaluate_first` (the default) evaluates before training, on purpose: under DDP stock then trains without DDP,
    so every DDP case also checks that hf_parallel still wraps the model. `iterable` trains on the rows as an
    iterable dataset (no length), which accelerate dispatches from rank 0 under DDP.
    """
    case = CASES[case_name]
    if stock:
        trainer_cls, args_cls = transformers.Trainer, transformers.TrainingArguments
    else:
        trainer_cls, args_cls = Trainer, TrainingArguments
    extra = overrides if stock else {"exact_loss": exact_loss, **overrides}
    capture = Capture()
    train_rows = case.dataset(train_rows, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        args = make_args(args_cls, tmp, topology, case.label_smoothing, **extra)
        trainer = trainer_cls(
            model=case.build(0),
            args=args,
            train_dataset=IterableRows(train_rows) if iterable else train_rows,
            eval_dataset=case.dataset(EVAL_ROWS, seed=2),
            callbacks=[capture],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        simulation = contextlib.nullcontext()
        if topology.dp_devices > 1:
            from hf_parallel.testing import simulate_data_parallel

            simulation = simulate_data_parallel(topology.dp_devices)
        with simulation:
            eval_loss = trainer.evaluate()["eval_loss"] if evaluate_first else None
            train_loss = trainer.train().training_loss
            if not evaluate_first:
                eval_loss = trainer.evaluate()["eval_loss"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        result = {
            "loss": capture.loss,
            "losses": capture.losses,
            "train_loss": train_loss,
            "eval_loss": eval_loss,
            "grads": capture.grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "wrapped": type(trainer.model_wrapped).__name__,
            "world_size": trainer.args.world_size,
            "parallel_mode": str(trainer.args.parallel_mode),
        }
    return result


def ddp_worker(case_names: list[str], topology: Topology, out_dir: str, stock: bool = False, overrides=None) -> None:
    """Body of each DDP rank (see `spawn_ranks`): runs every case, rank 0 saves the results."""
    results = {}
    for name in case_names:
        result = run_case(name, topology, stock=stock, **(overrides or {}))
        # Parameters must be equal on every rank, or the ranks trained apart.
        flat = torch.cat([p.flatten() for p in result["params"].values()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        result["max_rank_param_diff"] = max((g - flat).abs().max().item() for g in gathered)
        results[name] = result
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


def runs_worker(runs: dict[str, tuple[str, Topology, bool, dict]], out_dir: str) -> None:
    """Body of each DDP rank: every named run (case, topology, stock, overrides) in one spawn; rank 0 saves them."""
    results = {}
    for name, (case, topology, stock, overrides) in runs.items():
        result = run_case(case, topology, stock=stock, **overrides)
        flat = torch.cat([p.flatten() for p in result["params"].values()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        result["max_rank_param_diff"] = max((g - flat).abs().max().item() for g in gathered)
        results[name] = result
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_ddp_runs(runs: dict[str, tuple[str, Topology, bool, dict]], tmp_path, processes: int = 2) -> dict:
    spawn_ranks(runs_worker, (runs, str(tmp_path)), processes)
    return torch.load(os.path.join(tmp_path, "results.pt"), weights_only=False)


def run_ddp(case_names: list[str], topology: Topology, tmp_path, stock: bool = False, **overrides) -> dict:
    spawn_ranks(ddp_worker, (case_names, topology, str(tmp_path), stock, overrides), topology.processes)
    return torch.load(os.path.join(tmp_path, "results.pt"), weights_only=False)


def max_relative_diff(a: dict, b: dict) -> float:
    """
    Largest |a - b| over all tensors of two name -> tensor dicts, relative to the largest |b| of them all.

    Relative to the whole set, not per tensor: some gradients are zero in exact arithmetic (an attention key
    bias, a bias shared by all positions of a softmax) and per-tensor ratios of rounding noise mean nothing.
    """
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    scale = max(t.abs().max().item() for t in b.values()) or 1.0
    return max((a[name] - b[name]).abs().max().item() for name in a) / scale
