"""
Peak memory of training a causal LM whose forward fuses the loss with the LM head (Liger's fused linear
cross-entropy, `use_liger_kernel=True`), `hf_parallel.Trainer` against stock `transformers.Trainer`, printed as
ratios; the same for the plain (unpatched) LM as a control, and for a Mixtral-shaped MoE LM with its router loss on
(`moe`: its head recomputes the cross-entropy from the logits).

    python -m benchmarks.fused_memory                       # default sizes, 3 rounds: about 7 minutes on 2 cores
    python -m benchmarks.fused_memory --quick               # tiny sizes, 1 round, 1 step
    python -m benchmarks.fused_memory --rounds 5 --steps 4
    python -m benchmarks.fused_memory --liger               # on a GPU with liger-kernel installed

Workload: a LlamaForCausalLM from a config with a Llama-3 vocabulary (V = 128256), T = 128, 4 rows per device batch,
gradient accumulation 2, hidden size 64 and 2 layers, so that the `[rows, T, V]` logits dominate; labels -100 on
padding (uneven lengths). The fused LM is the plain one with `tests.helpers.fused.fuse_loss` applied to the instance
after it is built (a CPU stand-in for Liger, whose Triton kernel needs a GPU: chunks of `--chunk-size` rows, each under
activation checkpointing, so no more than one chunk's logits ever exist); the trainers are built with
`use_liger_kernel=False`, since liger-kernel is not installed here. On a GPU with liger-kernel installed, `--liger`
builds them with `use_liger_kernel=True` instead (transformers then patches the model itself; the stand-in's record of
which forwards built the full logits is not available then).

A run where the fused path works never builds the full logits in training; a trainer that takes the labels out of the
batch and recomputes the loss from the logits makes the model build them (and their float copy, log-softmax and
gradient), which the last column shows from the stand-in's record.

Time is the wall time of `trainer.train()` (the first step, with its check, included), as a ratio of medians.
Peak memory is measured as `benchmarks.overhead` does (see its docstring): on a GPU `torch.cuda.max_memory_allocated`;
on CPU the peak resident size during training (`VmHWM`, reset through /proc/self/clear_refs when training starts)
minus the resident size at that moment, each run in a fresh process whose glibc returns freed blocks at once, the
sides alternating, the median over `--rounds`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from benchmarks.overhead import MALLOC_ENV, REPO_ROOT, _peak, _reset_peak, _sides
from hf_parallel import Trainer, TrainingArguments
from hf_parallel.launch.validation import check_whole_number
from tests.helpers.fused import fuse_loss

WORKLOADS = ("fused", "plain", "moe")
SIDE_CLASSES = {
    "stock": (transformers.Trainer, transformers.TrainingArguments),
    "hf_parallel": (Trainer, TrainingArguments),
}
SIDES = tuple(SIDE_CLASSES)


@dataclasses.dataclass(frozen=True)
class Sizes:
    vocab: int = 128256
    seq: int = 128
    hidden: int = 64
    layers: int = 2
    rows: int = 4  # per device batch
    grad_accum: int = 2
    chunk: int = 32  # rows per fused chunk: 32 x 128256 fp32 logits, 16 MiB (the whole micro-batch's: 250 MiB)


QUICK = Sizes(vocab=4096, seq=32, hidden=32, layers=1, rows=4, grad_accum=2, chunk=16)


def build_model(sizes: Sizes, workload: str = "plain") -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=2 * sizes.hidden,
        num_hidden_layers=sizes.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=sizes.seq,
        use_cache=False,
    )
    if workload == "moe":
        # Mixtral-shaped: 4 experts, top 2, its router loss on (the MoE head recomputes the cross-entropy).
        config = MixtralConfig(
            **shape, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02
        )
        return MixtralForCausalLM(config)
    return LlamaForCausalLM(LlamaConfig(**shape))


class Rows(torch.utils.data.Dataset):
    """Token rows of uneven lengths; labels -100 on the padding."""

    def __init__(self, n: int, sizes: Sizes):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, sizes.vocab, (n, sizes.seq), generator=g)
        lengths = torch.randint(sizes.seq // 4, sizes.seq + 1, (n,), generator=g)
        self.mask = (torch.arange(sizes.seq)[None] < lengths[:, None]).long()
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def run_once(side: str, workload: str, sizes: Sizes, steps: int, liger: bool = False) -> dict:
    """One training run: its peak memory in bytes and, for the stand-in, which forwards built the full logits."""
    model = build_model(sizes, workload)
    record = fuse_loss(model, chunk_size=sizes.chunk) if workload == "fused" and not liger else None
    trainer_cls, args_cls = SIDE_CLASSES[side]
    with tempfile.TemporaryDirectory() as tmp:
        args = args_cls(
            output_dir=tmp,
            per_device_train_batch_size=sizes.rows,
            gradient_accumulation_steps=sizes.grad_accum,
            max_steps=steps,
            learning_rate=1e-4,
            logging_steps=10_000,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            use_liger_kernel=liger and workload == "fused",
        )
        rows = Rows(sizes.rows * sizes.grad_accum * steps, sizes)
        trainer = trainer_cls(model=model, args=args, train_dataset=rows)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        base = _reset_peak()
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        peak = _peak() - base
    forwards = None if record is None else {"fused": record.fused_calls, "logits": record.logits_calls}
    return {"peak": peak, "seconds": seconds, "forwards": forwards}


def fresh_run(side: str, workload: str, sizes: Sizes, steps: int, liger: bool) -> dict:
    """
    `run_once` in a fresh process whose resident size follows the live tensors (see `benchmarks.overhead`). A run that
    fails gives `{"error": its last line}`, its output going to stderr.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        spec = json.dumps({"side": side, "workload": workload, "sizes": dataclasses.asdict(sizes), "steps": steps})
        command = [sys.executable, "-m", "benchmarks.fused_memory", "--run", spec, out]
        if liger:
            command.append("--liger")
        done = subprocess.run(command, env={**os.environ, **MALLOC_ENV}, cwd=REPO_ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"run {side} {workload} failed:\n{done.stdout}{done.stderr}", file=sys.stderr)
            return {"error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
        with open(out) as file:
            return json.load(file)


def _in_process(side: str, workload: str, sizes: Sizes, steps: int, liger: bool) -> dict:
    try:
        return run_once(side, workload, sizes, steps, liger)
    except Exception as error:  # reported in the table, as a fresh run's failure is
        return {"error": f"{type(error).__name__}: {error}"}


def measure(
    sizes: Sizes, rounds: int, steps: int, liger: bool = False, fresh: bool = True, workloads=WORKLOADS
) -> dict:
    """
    For each workload and side: the median peak (MiB) over `rounds` runs, the forwards of the last run, and the error
    of a side that failed (its peak then None; it is not run again). `fresh=False` runs everything in this process:
    quicker, but its CPU peaks depend on what ran before.
    """
    results = {}
    for workload in workloads:
        peaks, seconds = {side: [] for side in SIDES}, {side: [] for side in SIDES}
        forwards, errors = {side: None for side in SIDES}, {}
        for r in range(rounds):
            for side in _sides(r):
                if side in errors:
                    continue
                run = (fresh_run if fresh else _in_process)(side, workload, sizes, steps, liger)
                if "error" in run:
                    errors[side] = run["error"]
                    continue
                peaks[side].append(run["peak"])
                seconds[side].append(run["seconds"])
                forwards[side] = run["forwards"]
        results[workload] = {
            "peak_mib": {side: None if side in errors else statistics.median(v) / 2**20 for side, v in peaks.items()},
            "seconds": {side: None if side in errors else statistics.median(v) for side, v in seconds.items()},
            "forwards": forwards,
            "errors": errors,
        }
    return results


def _logits_built(forwards: dict | None, error: str | None) -> str:
    if error is not None:
        return f"failed: {error}"
    if forwards is None:
        return "n/a"
    total = forwards["fused"] + forwards["logits"]
    return f"{'yes' if forwards['logits'] else 'no'} ({forwards['logits']} of {total} forwards)"


def table(results: dict) -> list[str]:
    header = [
        "workload",
        "stock MiB",
        "hf_parallel MiB",
        "ratio",
        "time ratio",
        "full logits built: stock",
        "hf_parallel",
    ]
    lines = [header]
    for workload, result in results.items():
        peak, forwards, errors = result["peak_mib"], result["forwards"], result["errors"]
        mib = ["failed" if peak[side] is None else f"{peak[side]:.1f}" for side in SIDES]
        ratio = "-" if None in peak.values() or peak["stock"] <= 0 else f"{peak['hf_parallel'] / peak['stock']:.3f}"
        taken = result.get("seconds", {})
        timed = "-" if None in taken.values() or not taken else f"{taken['hf_parallel'] / taken['stock']:.3f}"
        if workload == "fused":
            built = [_logits_built(forwards[side], errors.get(side)) for side in SIDES]
        else:
            built = [f"failed: {errors[side]}" if side in errors else "always" for side in SIDES]
        lines.append([workload, *mib, ratio, timed, *built])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return [" | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fused_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=None, help="runs of each side, each a fresh process (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 3)")
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk of the fused stand-in")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round of 1 step (a smoke run)")
    parser.add_argument("--liger", action="store_true", help="use_liger_kernel=True instead of the stand-in (GPU)")
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="which to run (default: all)"
    )
    # Internal: the body of one fresh run (SPEC a JSON of side, workload, sizes, steps; OUT the result's file).
    parser.add_argument("--run", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    quick = options.quick
    options.rounds = options.rounds if options.rounds is not None else 1 if quick else 3
    options.steps = options.steps if options.steps is not None else 1 if quick else 3
    sizes = QUICK if quick else Sizes()
    options.sizes = sizes if options.chunk_size is None else dataclasses.replace(sizes, chunk=options.chunk_size)
    try:
        for name in ("rounds", "steps"):
            check_whole_number("--" + name, getattr(options, name), 1)
        check_whole_number("--chunk-size", options.sizes.chunk, 1)
    except ValueError as error:
        parser.error(str(error))
    if options.liger and importlib.util.find_spec("liger_kernel") is None:
        parser.error("--liger needs liger-kernel (pip install liger-kernel; Triton, a GPU): it is not installed.")
    return options


def main(argv: list[str] | None = None) -> dict | None:
    options = _parse(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if options.run:
        spec, out = json.loads(options.run[0]), options.run[1]
        result = run_once(spec["side"], spec["workload"], Sizes(**spec["sizes"]), spec["steps"], options.liger)
        with open(out, "w") as file:
            json.dump(result, file)
        return None
    sizes = options.sizes
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}; V={sizes.vocab} T={sizes.seq} "
        f"hidden={sizes.hidden} layers={sizes.layers} rows/device={sizes.rows} GA={sizes.grad_accum} "
        f"chunk={sizes.chunk} rows; {options.steps} steps, median of {options.rounds} rounds; "
        f"{'use_liger_kernel=True' if options.liger else 'fused stand-in (tests.helpers.fused)'}"
    )
    results = measure(sizes, options.rounds, options.steps, options.liger, workloads=options.workloads)
    print("\n".join(table(results)))
    return results


if __name__ == "__main__":
    main()
