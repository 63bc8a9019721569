"""
Overhead of the exact loss: step time and peak memory of `hf_parallel.Trainer` against stock
`transformers.Trainer` on the same workload, interleaved, printed as median ratios.

    python -m benchmarks.overhead                 # single process and 2-rank DDP (gloo, CPU)
    python -m benchmarks.overhead --no-ddp --steps 30 --rounds 5 --memory-rounds 3

Workloads: a BERT sequence classifier and a small GPT-2 causal LM, built from configs (nothing downloaded).
Step time: the median over all timed optimizer steps (the first steps of each run are warm-up), all runs of a mode
in one process (DDP: in one spawn of 2 ranks), stock and hf_parallel alternating. Peak memory: on a GPU,
`torch.cuda.max_memory_allocated` during those timed runs. On CPU, the peak resident set size during training
(`VmHWM`, reset through /proc/self/clear_refs when training starts) minus the resident size at that moment, each
run (DDP: each spawn of 2 ranks, rank 0 reporting) in a fresh process, the sides alternating, the median over
`--memory-rounds`. That process has glibc serve every block over 64 KiB by mmap and return it at once
(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`), so that the resident size follows the tensors alive, not
what glibc keeps cached; such allocation is slower, so these are not the runs that time the steps. A fresh process
per run, because even so the resident peak depends on what ran before in the same process: with every run in one
process, the causal LM's peak read 132.0 MiB for stock and 148.4 MiB for hf_parallel (ratio 1.124; 1.166 under
DDP), while the same runs each in a fresh process read 168.6 and 168.9 MiB (ratio 1.002).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from hf_parallel import Trainer, TrainingArguments
from hf_parallel.launch.validation import check_whole_number

# Big enough that the loss's tensors (the LM's logits: 8 x 128 x 8000 floats, 33 MB) show in peak memory.
SEQ = 128
VOCAB = 8000
# A CPU memory run: its peak is reached within the first optimizer steps (the optimizer's state is made in the first).
MEMORY_STEPS, MEMORY_WARMUP = 2, 1
# glibc serves every block over 64 KiB by mmap and returns freed memory at once (see the module docstring).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def classifier():
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=SEQ,
        num_labels=4,
    )
    return BertForSequenceClassification(config)


def causal_lm():
    config = GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=SEQ, use_cache=False)
    return GPT2LMHeadModel(config)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, lm: bool):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        lengths = torch.randint(SEQ // 4, SEQ + 1, (n,), generator=g)
        self.mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        self.labels = self.ids.masked_fill(self.mask == 0, -100) if lm else torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


WORKLOADS = {"classifier": (classifier, False, 16), "causal_lm": (causal_lm, True, 8)}


class StepTimer(transformers.TrainerCallback):
    def __init__(self, warmup: int):
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _reset_peak() -> int:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident size
    return _rss_kib("VmRSS") * 1024


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _rss_kib("VmHWM") * 1024


def run_once(stock: bool, workload: str, steps: int, warmup: int) -> tuple[list[float], int]:
    build, lm, batch = WORKLOADS[workload]
    torch.manual_seed(0)
    model = build()
    timer = StepTimer(warmup)
    if stock:
        trainer_cls, args_cls = transformers.Trainer, transformers.TrainingArguments
    else:
        trainer_cls, args_cls = Trainer, TrainingArguments
    with tempfile.TemporaryDirectory() as tmp:
        args = args_cls(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            max_steps=steps + warmup,
            learning_rate=1e-4,
            logging_steps=10_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
        )
        rows = Rows(batch * (steps + warmup) * 2, lm)
        trainer = trainer_cls(model=model, args=args, train_dataset=rows, callbacks=[timer])
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # one line per run, not per log
        base = _reset_peak()
        trainer.train()
        peak = _peak() - base
    return timer.times, peak


def _sides(round_index: int) -> tuple[str, str]:
    # Alternate which goes first, so warm caches and background load do not favour one side.
    return ("stock", "hf_parallel") if round_index % 2 == 0 else ("hf_parallel", "stock")


def measure(workload: str, steps: int, warmup: int, rounds: int) -> dict:
    times = {"stock": [], "hf_parallel": []}
    peaks = {"stock": [], "hf_parallel": []}
    for r in range(rounds):
        for name in _sides(r):
            step_times, peak = run_once(name == "stock", workload, steps, warmup)
            times[name].extend(step_times)
            peaks[name].append(peak)
    return {
        "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "peak_mib": {k: statistics.median(v) / 2**20 for k, v in peaks.items()},
    }


def measure_workloads(steps: int, warmup: int, rounds: int) -> dict:
    return {w: measure(w, steps, warmup, rounds) for w in WORKLOADS}


def report(mode: str, times: dict, memory: dict) -> None:
    for workload in times:
        step, peak = times[workload]["step_ms"], memory[workload]["peak_mib"]
        mem_ratio = peak["hf_parallel"] / peak["stock"] if peak["stock"] > 0 else float("nan")
        print(
            f"{mode:<14} {workload:<11} step median: stock {step['stock']:7.2f} ms, "
            f"hf_parallel {step['hf_parallel']:7.2f} ms, ratio {step['hf_parallel'] / step['stock']:.3f} | "
            f"peak: stock {peak['stock']:7.1f} MiB, hf_parallel {peak['hf_parallel']:7.1f} MiB, ratio {mem_ratio:.3f}"
        )


def rank0_saves(function, args: tuple, out: str) -> None:
    import torch.distributed as dist

    result = function(*args)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def in_two_ranks(function, args: tuple):
    """`function(*args)` in each of 2 spawned DDP ranks on CPU; returns rank 0's result."""
    from hf_parallel.testing import spawn_cpu_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        spawn_cpu_ranks(rank0_saves, (function, args, out), 2)
        return torch.load(out, weights_only=False)


def measure_all(steps: int, warmup: int, rounds: int, ddp: bool) -> dict:
    results = {"single": measure_workloads(steps, warmup, rounds)}
    if ddp:
        results["ddp"] = in_two_ranks(measure_workloads, (steps, warmup, rounds))
    return results


def memory_run(mode: str, side: str, workload: str, out: str) -> None:
    """The body of a fresh memory process: one short run, its peak (in bytes) written to `out`."""
    args = (side == "stock", workload, MEMORY_STEPS, MEMORY_WARMUP)
    _, peak = run_once(*args) if mode == "single" else in_two_ranks(run_once, args)
    with open(out, "w") as file:
        file.write(str(peak))


def fresh_peak(mode: str, side: str, workload: str) -> int:
    """Peak memory of one run in a fresh process whose resident size follows the live tensors (see above)."""
    return peak_in_fresh_process("benchmarks.overhead", [mode, side, workload])


def peak_in_fresh_process(module: str, memory_run: list[str]) -> int:
    """
    `python -m module --memory-run *memory_run OUT` in a fresh process whose resident size follows the live tensors
    (see above): the peak (bytes) it writes to OUT.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peak.txt")
        command = [sys.executable, "-m", module, "--memory-run", *memory_run, out]
        # Its output is library warnings, once per process; shown only when the run fails.
        done = subprocess.run(command, env={**os.environ, **MALLOC_ENV}, cwd=REPO_ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"memory run {' '.join(memory_run)} failed:\n{done.stdout}{done.stderr}")
        with open(out) as file:
            return int(file.read())


def parse_run_options(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options of a timing benchmark (`--steps`, `--rounds`, `--memory-rounds` at least 1, `--warmup` at least 0,
    refused naming the option), the libraries' warnings quieted for its output."""
    options = parser.parse_args()
    try:
        for name in ("steps", "rounds", "memory_rounds"):
            check_whole_number("--" + name.replace("_", "-"), getattr(options, name), 1)
        check_whole_number("--warmup", options.warmup, 0)
    except ValueError as error:
        parser.error(str(error))
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return options


def measure_memory(rounds: int, ddp: bool) -> dict:
    memory = {}
    for mode in ("single", "ddp") if ddp else ("single",):
        memory[mode] = {}
        for workload in WORKLOADS:
            peaks = {"stock": [], "hf_parallel": []}
            for r in range(rounds):
                for side in _sides(r):
                    peaks[side].append(fresh_peak(mode, side, workload))
            memory[mode][workload] = {"peak_mib": {k: statistics.median(v) / 2**20 for k, v in peaks.items()}}
    return memory


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each trainer, interleaved (default 3)")
    parser.add_argument(
        "--memory-rounds",
        type=int,
        default=2,
        help="CPU memory runs of each trainer, each a fresh process (default 2)",
    )
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-rank DDP measurement")
    # Internal: the body of one fresh CPU memory process (MODE is single or ddp, SIDE stock or hf_parallel).
    parser.add_argument("--memory-run", nargs=4, metavar=("MODE", "SIDE", "WORKLOAD", "OUT"), help=argparse.SUPPRESS)
    options = parse_run_options(parser)
    if options.memory_run:
        memory_run(*options.memory_run)
        return

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    timed = measure_all(options.steps, options.warmup, options.rounds, not options.no_ddp)
    # On CPU the timed runs' resident peaks depend on the runs before them in the same process (see above).
    memory = timed if torch.cuda.is_available() else measure_memory(options.memory_rounds, not options.no_ddp)
    report("single process", timed["single"], memory["single"])
    if "ddp" in timed:
        report("DDP 2 (rank 0)", timed["ddp"], memory["ddp"])


if __name__ == "__main__":
    main()
