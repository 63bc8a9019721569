"""
`hf_parallel.Trainer` through torch's real `nn.DataParallel` replicas on a GPU, against one device (step 2 of
`benchmarks.gpu_check`; see there). One SGD step per configuration, the loss logged and the parameters after it
compared with a one-device run on the same rows; then hf_parallel's own synchronising CUDA calls after the first step,
in steps run through the DataParallel wrappers a user's `hf_parallel.Trainer` builds (`ExactDataParallel`, and
`BalancedDataParallel` for `gpu0_bsz`) over the same `device_ids` (the dry run runs them, with nothing to watch).

    python -m benchmarks.gpu_dp_check             # one GPU: device_ids [0, 0]; two or more: [0, 1]
    python -m benchmarks.gpu_dp_check --dry_run   # no GPU: the CPU emulation of DataParallel over 2 devices

Prints one line per configuration, then `FIGURES {json}`; exit code 1 when a configuration is off (fp32: relative
difference above 1e-5; bf16: above 3e-2) or failed, or when a sync was found.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
import transformers

import hf_parallel
from hf_parallel import BalancedDataParallel, ExactDataParallel
from hf_parallel.testing import simulate_data_parallel, simulated_training_args
from tests.helpers.heads import CASES

MODELS = ("gpt2_causal_lm", "llama_causal_lm")  # tied embeddings, untied
WRAPPERS = ("even", "gpu0_bsz=0", "gpu0_bsz=1")
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}
ROWS, STEP = 8, dict(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0)
PACKAGE = str(Path(hf_parallel.__file__).parent)


class OnDevices(hf_parallel.Trainer):
    """hf_parallel.Trainer whose DataParallel wrapper is the one given (over chosen device_ids, e.g. [0, 0])."""

    def __init__(self, *args, wrap=None, **kwargs):
        self.wrap = wrap
        super().__init__(*args, **kwargs)

    def _wrap_model(self, model, training=True, dataloader=None):
        if self.wrap is None or self.accelerator.unwrap_model(model) is not model:
            return super()._wrap_model(model, training, dataloader)
        return self.wrap(model)


def _wrapper(name: str, device_ids: list[int]):
    if name == "even":
        return lambda model: ExactDataParallel(model, device_ids=device_ids)
    return lambda model: BalancedDataParallel(model, device_ids=device_ids, gpu0_bsz=int(name.split("=")[1]))


def train(case: str, precision: str, dry_run: bool, wrap=None, steps: int = 1, callbacks=()) -> dict:
    spec = CASES[case]
    with tempfile.TemporaryDirectory() as out:
        common = dict(
            output_dir=out, report_to="none", save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
            max_steps=steps, logging_steps=1, remove_unused_columns=False, use_cpu=dry_run,
            bf16=precision == "bf16", **STEP,
        )  # fmt: skip
        if wrap is None:
            args = hf_parallel.TrainingArguments(per_device_train_batch_size=ROWS, **common)
        else:
            args = simulated_training_args(2, per_device_train_batch_size=ROWS // 2, **common)
        trainer = OnDevices(
            model=spec.build(0), args=args, train_dataset=spec.dataset(ROWS * steps, seed=1), wrap=wrap,
            callbacks=list(callbacks),
        )  # fmt: skip
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        model = trainer.accelerator.unwrap_model(trainer.model)
        params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
        return {"loss": losses[0], "params": params, "wrapper": type(trainer.model_wrapped).__name__}


def relative(result: dict, reference: dict) -> tuple[float, float]:
    loss = abs(result["loss"] / reference["loss"] - 1)
    scale = max(t.abs().max().item() for t in reference["params"].values())
    params = max((result["params"][n] - t).abs().max().item() for n, t in reference["params"].items()) / scale
    return loss, params


class _Syncs(transformers.TrainerCallback):
    """After the first step, CUDA's sync debug mode warns at every synchronising call (a dry run has no CUDA)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def on_step_begin(self, args, state, control, **kwargs):
        if self.cuda and state.global_step >= 1:
            torch.cuda.set_sync_debug_mode("warn")

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")


def syncs_in_package(device_ids: list[int], dry_run: bool) -> dict[str, list[str]]:
    """
    Per wrapper a user's Trainer builds (the even split, `gpu0_bsz`): hf_parallel's synchronising calls in steps 2 and
    3, each step run through that DataParallel wrapper over `device_ids`, as a training step on several GPUs is.
    """
    found = {}
    for name, expected in (("even", "ExactDataParallel"), ("gpu0_bsz=1", "BalancedDataParallel")):
        emulation = simulate_data_parallel(2) if dry_run else contextlib.nullcontext()
        with warnings.catch_warnings(record=True) as caught, emulation:
            warnings.simplefilter("always")
            wrap = _wrapper(name, device_ids)
            result = train("llama_causal_lm", "fp32", dry_run, wrap, steps=3, callbacks=(_Syncs(not dry_run),))
        if result["wrapper"] != expected:  # the check would watch another path than a user's
            raise RuntimeError(f"the sync check ran through {result['wrapper']}, not {expected}")
        found[result["wrapper"]] = sorted(
            {f"{Path(w.filename).name}:{w.lineno}" for w in caught if w.filename.startswith(PACKAGE)}
        )
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry_run", action="store_true")
    dry_run = parser.parse_args(argv).dry_run
    if not dry_run:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: compare like with like
        torch.backends.cudnn.allow_tf32 = False
    device_ids = [0, 1] if dry_run or torch.cuda.device_count() > 1 else [0, 0]
    figures, failed = {"device_ids": device_ids, "runs": {}}, False
    for precision in ("fp32", "bf16"):
        for case in MODELS:
            reference = train(case, precision, dry_run)
            for name in WRAPPERS:
                label = f"{case} {precision} {name}"
                emulation = simulate_data_parallel(2) if dry_run else contextlib.nullcontext()
                try:
                    with emulation:
                        loss, params = relative(train(case, precision, dry_run, _wrapper(name, device_ids)), reference)
                except Exception:
                    traceback.print_exc()
                    figures["runs"][label], failed = "error", True
                    print(f"{label}: ERROR", flush=True)
                    continue
                ok = max(loss, params) <= TOLERANCE[precision]
                failed |= not ok
                figures["runs"][label] = {"loss_rel": loss, "params_rel": params, "ok": ok}
                print(f"{label}: loss {loss:.2e}, parameters {params:.2e} {'ok' if ok else 'OFF'}", flush=True)
    try:
        found = syncs_in_package(device_ids, dry_run)
    except Exception:
        traceback.print_exc()
        found, failed = "error", True
    if not dry_run:
        figures["syncs_in_hf_parallel"] = found
        failed |= found != "error" and any(found.values())
    if found == "error":
        print("synchronising calls: the check failed (traceback above)", flush=True)
    elif dry_run:  # a CPU has no CUDA syncs to report
        print(f"synchronising calls: not watched in a dry run; steps 2-3 ran through {', '.join(found)}", flush=True)
    else:
        print(f"synchronising calls from hf_parallel after the first step, per wrapper: {found}", flush=True)
    print("FIGURES " + json.dumps(figures), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
