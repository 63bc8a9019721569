"""
A run that a crash interrupts: killed (SIGKILL, as a scheduler's pre-emption or the OOM killer) in the middle of a
checkpoint save, or one rank killed in the middle of training; then relaunched with `--resume`.

    PYTHONPATH=. python -m tests.distributed.crash_worker OUT_DIR [--stock] [--per-device B] [--accumulation G]
        [--kill-in-save STEP] [--kill-at-step STEP] [--kill-rank R] [--resume] [--max-steps N] [--fsdp]

One process, `torchrun` (the ranks come from the launcher's environment) or `spawn_cpu_ranks` (`run` called in each
rank). A tiny BERT classifier, 16 rows, global batch 8 unless told otherwise, 6 plain SGD steps (three
epochs), a checkpoint every 2 steps, `save_total_limit=1`. Rank 0 writes the final parameters to OUT_DIR/final.pt.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from hf_parallel import Trainer, TrainingArguments  # noqa: E402
from tests.helpers.harness import SGD_STEP, training_args  # noqa: E402
from tests.helpers.heads import CASES  # noqa: E402

CASE = "bert_single_label"
ROWS = 16
MAX_STEPS = 6
SAVE_STEPS = 2
FSDP_CASE = "llama_causal_lm"
FSDP_CONFIG = {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}


class _KillInSave:
    """Mixed into the Trainer: SIGKILL this process while the checkpoint of `step` is written (weights and optimizer
    on disk, its RNG state and trainer_state.json not yet)."""

    kill_in_save: int | None = None

    def _save_rng_state(self, output_dir):
        if self.state.global_step == self.kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._save_rng_state(output_dir)


class CrashingTrainer(_KillInSave, Trainer):
    pass


class CrashingStockTrainer(_KillInSave, transformers.Trainer):
    pass


class _KillAtStep(transformers.TrainerCallback):
    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == self.rank:
            print(f"crash_worker: rank {self.rank} kills itself at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def make_trainer(
    out_dir: str, stock: bool = False, per_device: int = 8, accumulation: int = 1, case: str = CASE, **overrides
):
    """The run's trainer (also the in-process reference's)."""
    case = CASES[case]
    trainer_cls = CrashingStockTrainer if stock else CrashingTrainer
    arguments = {**SGD_STEP, "max_steps": MAX_STEPS, "save_strategy": "steps", "save_steps": SAVE_STEPS}
    arguments.update(
        save_total_limit=1, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation
    )
    arguments.update(overrides)
    args_cls = transformers.TrainingArguments if stock else TrainingArguments
    trainer = trainer_cls(
        model=case.build(0),
        args=training_args(out_dir, args_cls=args_cls, **arguments),
        train_dataset=case.dataset(ROWS),
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


def run(
    out_dir: str,
    stock: bool = False,
    per_device: int = 8,
    accumulation: int = 1,
    resume: bool | str | None = None,
    kill_in_save: int | None = None,
    kill_at_step: int | None = None,
    kill_rank: int = 0,
    max_steps: int = MAX_STEPS,
    fsdp: bool = False,
) -> dict:
    """
    Train (from `resume`); the final parameters, also written to OUT_DIR/final.pt by rank 0. `fsdp`: FSDP2 on this
    process's GPU with sharded checkpoints (`SHARDED_STATE_DICT`: each rank writes its own shard files).
    """
    # FSDP2 trains a Llama: accelerate shards a model's input embeddings on their own after its `_no_split_modules`,
    # which for BERT include the embeddings module (sharded twice, torch's fully_shard fails).
    options = dict(case=FSDP_CASE, use_cpu=False, fsdp=True, fsdp_config=FSDP_CONFIG) if fsdp else {}
    trainer = make_trainer(out_dir, stock, per_device, accumulation, max_steps=max_steps, **options)
    trainer.kill_in_save = kill_in_save
    if kill_at_step is not None:
        trainer.add_callback(_KillAtStep(kill_at_step, kill_rank))
    trainer.train(resume_from_checkpoint=resume)
    model = trainer.accelerator.unwrap_model(trainer.model)
    # Under FSDP2 a parameter is a DTensor: its full value, on the CPU.
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    params = {n: p.detach().cpu().clone() for n, p in full.items()}
    if trainer.args.process_index == 0:
        torch.save(params, os.path.join(out_dir, "final.pt"))
    return params


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--stock", action="store_true")
    parser.add_argument("--per-device", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-in-save", type=int)
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS)
    parser.add_argument("--fsdp", action="store_true")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # two ranks on two cores
    run(
        options.out_dir,
        options.stock,
        options.per_device,
        options.accumulation,
        True if options.resume else None,
        options.kill_in_save,
        options.kill_at_step,
        options.kill_rank,
        options.max_steps,
        options.fsdp,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
