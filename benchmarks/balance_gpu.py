"""
GPU 0's memory under DataParallel, measured through the Trainers themselves on a causal LM: the stock
`transformers.Trainer` under its own `nn.DataParallel` against `hf_parallel.Trainer` (exact loss) with an even split
and with several `gpu0_bsz`: peak memory per GPU, samples per second and the largest batch that fits, with ratios
against stock measured in the same run.

    python -m benchmarks.balance_gpu                          # every visible GPU (one GPU: device_ids [0, 0])
    python -m benchmarks.balance_gpu --gpu0_bsz 0 2 4 --search --cap_gib 64
    python -m benchmarks.balance_gpu --dtype fp32 --vocab_size 32000 --seq_len 1024 --batch_size 32
    python -m benchmarks.balance_gpu --dry_run 3              # no GPU: the same flow on 3 emulated devices

Targets for a GPU run, each printed with PASS or MISS:
1. GPU 0's peak under exact DataParallel (`hf_parallel.Trainer`, no `gpu0_bsz`) <= stock's.
2. With `gpu0_bsz`, GPU 0's peak >= 30% below stock's at the same global batch (met by at least one value tried).

Workload: `LlamaForCausalLM` built from a `LlamaConfig` (nothing downloaded; defaults: vocabulary 128256, sequence
2048, hidden 1024, 8 layers, 16 heads with 8 key/value heads, MLP 4096, about 0.39 B parameters), its weights in bf16
(`--dtype fp32` for fp32) and no autocast: `bf16=True` is a no-op for the stock Trainer under DataParallel
(transformers 5.24 skips mixed precision for a wrapped model), so it would compare two precisions. The data are
random token ids, the labels a copy of them (every token a target after the shift); the per-step batch
(`--batch_size`, default 8 per entry of `device_ids`, 16 on one GPU) is the same for every configuration.

Configurations, each run by `trainer.train()` with `max_steps` (`report_to=[]`, `save_strategy="no"`), so that the
step measured is each library's own: stock (`labels` passed to the model, each replica computes its rows' loss, the
Trainer takes `loss.mean()`), `hf_parallel.Trainer` with the even split, and `hf_parallel.Trainer` with each
`gpu0_bsz` (default: 0, 1/4 and 1/2 of GPU 0's even share).

- Peak memory, steady state: `torch.cuda.max_memory_allocated(d)` of each GPU over the steps after the warm-up: the
  peak statistics are reset at the end of step `--warmup` (at least 1: the first step allocates the optimizer state),
  and for hf_parallel again at the end of each later step while its check of the loss head against the model's own
  loss is undecided (a checked forward keeps the labels in the model's inputs and computes the candidate heads;
  usually the first step alone, up to 8 on an untrained model whose loss cannot tell the candidate heads apart), as
  long as a step remains.
  So the check's steps are excluded; the table says which steps the peak covers and whether the check had settled
  before them (`UNDECIDED`: it ran on to the end, and the peak includes it), and the warm-up's own peak (the check's
  included) is printed below it.
- Samples/s: the per-step batch over the median time of the steps the peak covers.
- Largest batch (`--search`): every GPU capped at `--cap_gib`, the largest per-step batch (a multiple of the number of
  devices) that trains two steps without running out of memory (the first step's check included: a real run must
  get through it too), by bisection up to `--max_batch`, for at most `--search_seconds` per configuration (a search
  stopped by the clock prints its lower bound as `>= n`).
- The analytic cost of recomputing the loss from the gathered logits on GPU 0 (`B*T*V*4` bytes of fp32 logits in
  forward, about 3x at the backward peak), for the sizes chosen and for B=16, T=2048, V=128256.

With one GPU, DataParallel runs over `device_ids=[0, 0]`: two replicas on one GPU, torch's real scatter, replicate
and gather, but both "devices" share one memory, so the per-device peaks coincide (target 2 cannot be assessed
there). `--dry_run N` runs the same configurations on CPU through `hf_parallel.testing` (`simulate_data_parallel`:
torch's own DataParallel on N virtual devices; `simulated_training_args`) with a tiny model: a check that the script
works end to end, with no memory figures.

Exit codes: 0 after printing the figures; 1 when a configuration failed with an error other than running out of
memory (its traceback on stderr, the other configurations' figures printed); 2 without a CUDA GPU (nothing is
measured; the message points to `--dry_run`).
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import LlamaForCausalLM

from benchmarks.gpu_steps import DTYPES, GIB, Bench, Config, Result, measure, model_config

FAILED_EXIT = 1
NO_GPU_EXIT = 2
TARGETS = (
    "GPU 0's peak under exact DataParallel <= stock's",
    "with gpu0_bsz, >= 30% below stock at the same global batch",
)
TARGET_REDUCTION = 0.30
REFERENCE_SIZES = (16, 2048, 128256)  # B, T, V of the reference figure (a Llama 3 vocabulary)
CHECK = {True: "settled", False: "UNDECIDED (its steps counted)"}
TINY = dict(vocab_size=256, seq_len=32, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate=64)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--batch_size", type=int, default=0, help="per-step batch, a multiple of the devices (default: 8 per device)")
    add("--gpu0_bsz", type=int, nargs="+", default=None, help="values to try (default: 0, 1/4, 1/2 of the even share)")
    add("--device_ids", type=int, nargs="+", default=None, help="default: every GPU; [0, 0] with one")
    add("--dtype", choices=sorted(DTYPES), default="bf16", help="the weights' dtype (no autocast)")
    add("--vocab_size", type=int, default=128256)
    add("--seq_len", type=int, default=2048)
    add("--hidden_size", type=int, default=1024)
    add("--num_layers", type=int, default=8)
    add("--num_heads", type=int, default=16)
    add("--num_kv_heads", type=int, default=8)
    add("--intermediate", type=int, default=4096, help="the MLP's width")
    add("--no_cache", action="store_true", help="use_cache=False in the config (default: the config's True)")
    add(
        "--warmup",
        type=int,
        default=2,
        help="steps before the peak and the time are measured, >= 1 (the first allocates the optimizer state and "
        "runs hf_parallel's check of its loss head)",
    )
    add("--steps", type=int, default=5, help="timed steps per configuration")
    add("--search", action="store_true", help="also find the largest per-step batch under --cap_gib")
    add("--cap_gib", type=float, default=64.0, help="memory cap per GPU for --search")
    add("--max_batch", type=int, default=0, help="upper end of --search (default: 64 per device)")
    add("--search_seconds", type=float, default=60.0, help="time bound of --search per configuration")
    add("--dry_run", type=int, default=0, metavar="N", help="CPU, N emulated devices, a tiny model")
    args = parser.parse_args(argv)
    for name in ("warmup", "steps", "dry_run", "batch_size", "max_batch"):
        minimum = 1 if name in ("warmup", "steps") else 0
        if getattr(args, name) < minimum:
            parser.error(f"--{name} must be >= {minimum}, got {getattr(args, name)}.")
    if args.dry_run == 1:
        parser.error("--dry_run 1 emulates one device, where there is nothing to balance: give 2 or more.")
    return args


def choose_devices(args) -> list[int]:
    """device_ids for DataParallel: the given ones, else every GPU, or [0, 0] on one GPU."""
    count = torch.cuda.device_count()
    if args.device_ids is None:
        return list(range(count)) if count > 1 else [0, 0]
    if len(args.device_ids) < 2 or any(not 0 <= d < count for d in args.device_ids):
        raise SystemExit(
            f"--device_ids {args.device_ids}: give two or more ids among the {count} visible GPUs (0..{count - 1}); "
            "a repeated id runs several replicas on one GPU, e.g. --device_ids 0 0."
        )
    return list(args.device_ids)


# ---- The printout ----


def gathered_loss_line(label: str, batch: int, seq_len: int, vocab: int, dtype: str) -> str:
    """What recomputing the loss from the logits gathered on GPU 0 puts there, whatever gpu0_bsz is."""
    elements = batch * seq_len * vocab
    gathered = elements * DTYPES[dtype].itemsize
    fp32 = elements * 4
    return (
        f"  {label} (B={batch}, T={seq_len}, V={vocab}, {dtype}): the gathered logits {size(gathered)}, their fp32 "
        f"copy B*T*V*4 = {size(fp32)} in forward, x3 = {size(3 * fp32)} at the backward peak"
    )


def size(count: int) -> str:
    """Bytes in GiB, or in MiB / KiB when below one (the dry run's tiny sizes)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count / 2**10:.2f} KiB"


def print_workload(bench: Bench, parameters: int) -> None:
    args = bench.args
    print(
        f"\nLlamaForCausalLM from a config: vocab {args.vocab_size}, seq_len {args.seq_len}, "
        f"hidden {args.hidden_size}, "
        f"{args.num_layers} layers, {args.num_heads} heads ({args.num_kv_heads} KV), MLP {args.intermediate}; "
        f"{parameters:,} parameters in {args.dtype} (no autocast), use_cache={not args.no_cache}; "
        f"per-step batch {args.batch_size} on device_ids {bench.device_ids}; {args.warmup} warm-up + {args.steps} "
        "measured steps per configuration. Peaks and samples/s are steady state: over the steps after the warm-up "
        "and after hf_parallel's check of its loss head (its peak reset until the check settles)."
    )
    if args.dry_run:
        print(
            f"Dry run: {args.dry_run} devices emulated on CPU, a tiny model; no memory figures, targets not assessed."
        )
    elif bench.one_gpu:
        print(
            "One GPU: both replicas share its memory, so the per-device peaks below are one figure (the whole batch); "
            "target 2 needs two GPUs or more."
        )


def measured_steps(result: Result, steps: int) -> str:
    """The steps the peak and the time cover, and whether hf_parallel's check had settled before them."""
    if result.since is None:
        return "all (stopped early)"
    covered = f"{result.since + 1}-{steps}"
    return covered if result.check_settled is None else f"{covered}, check {CHECK[result.check_settled]}"


def print_table(results: list[Result], bench: Bench) -> None:
    stock, steps = results[0], bench.args.warmup + bench.args.steps
    header = f"{'configuration':<30}{'wrapper':<22}{'split (GPU 0 first)':<22}{'samples/s':>10}{'x stock':>8}"
    header += f"{'loss':>9}  {'steps measured':<26}"
    if bench.devices:
        header += "peak GiB per GPU (x stock)"
    print("\n" + header)
    for r in results:
        line = f"{r.config.label:<30}{r.wrapper:<22}{str(r.split):<22}"
        if r.failure is not None:
            line += f"{r.failure:>27}"
        else:
            speed = "" if stock.samples_per_s is None else f"{r.samples_per_s / stock.samples_per_s:.2f}"
            line += f"{r.samples_per_s:>10.2f}{speed:>8}{r.train_loss:>9.4f}"
        line += f"  {measured_steps(r, steps):<26}"
        if bench.devices:
            line += ", ".join(f"{p / GIB:.2f} ({ratio(p, s)})" for p, s in zip(r.peaks, stock.peaks, strict=True))
        print(line)
    if bench.devices:
        print("\nWarm-up peak GiB per GPU (the steps before those measured: optimizer state, hf_parallel's check):")
        for r in results:
            if r.since is not None:
                print(
                    f"  {r.config.label:<30}steps 1-{r.since}: " + ", ".join(f"{p / GIB:.2f}" for p in r.warmup_peaks)
                )
    if bench.args.search:
        print(f"\nLargest per-step batch with every GPU capped at {bench.args.cap_gib} GiB (x stock):")
        for r in results:
            found = "-" if r.largest is None else ("" if r.largest_exact else ">= ") + str(r.largest)
            times = "" if r.largest is None or not stock.largest else f" ({r.largest / stock.largest:.2f})"
            print(f"  {r.config.label:<30}{found}{times}")


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}" if reference else "-"


def print_analytic(bench: Bench) -> None:
    args = bench.args
    print(
        "\nRecomputing the loss from the logits gathered on GPU 0 (hf_parallel's former exact loss under "
        "DataParallel) puts there, whatever gpu0_bsz is:"
    )
    print(gathered_loss_line("these sizes", args.batch_size, args.seq_len, args.vocab_size, args.dtype))
    print(gathered_loss_line("reference", *REFERENCE_SIZES, "bf16"))
    print(
        "  Stock gathers the logits too (DataParallel gathers every output) but computes each replica's loss where "
        "its rows are. Per-replica loss sums and item counts, with no logits gathered, leave on GPU 0 only its own "
        "rows' share of the fp32 figures (its rows / B) and bring it [rows, terms] numbers from the others."
    )


def assess(results: list[Result], bench: Bench) -> list[str]:
    """One line per target, with PASS or MISS (or why it cannot be assessed)."""
    if bench.args.dry_run:
        return [f"  {i}. {t}: not assessed in a dry run" for i, t in enumerate(TARGETS, 1)]
    stock, exact, balanced = results[0], results[1], results[2:]
    if stock.failure is not None:
        if stock.failure == "out of memory" and exact.failure is None:
            first = "PASS (stock ran out of memory, exact did not)"
        else:
            first = f"not assessed: stock failed ({stock.failure}); exact: {exact.failure or 'ran'}"
        return [f"  1. {TARGETS[0]}: {first}", f"  2. {TARGETS[1]}: not assessed: stock failed ({stock.failure})"]
    base = stock.peaks[0]
    if exact.failure is not None:
        first = f"MISS ({exact.failure})"
    else:
        first = f"{size(exact.peaks[0])} vs {size(base)}: {'PASS' if exact.peaks[0] <= base else 'MISS'}"
        if exact.check_settled is False:
            first += " (hf_parallel's check of its loss head was still undecided: its steps are in its peak)"
    lines = [f"  1. {TARGETS[0]}: {first}"]
    if bench.one_gpu:
        return lines + [f"  2. {TARGETS[1]}: not assessed on one GPU (the replicas share its memory)"]
    cuts = {r.config.gpu0_bsz: r.failure or f"{1 - r.peaks[0] / base:.0%} below" for r in balanced}
    met = any(r.failure is None and r.peaks[0] <= (1 - TARGET_REDUCTION) * base for r in balanced)
    shown = ", ".join(f"gpu0_bsz={g}: {cut}" for g, cut in cuts.items())
    return lines + [f"  2. {TARGETS[1]}: {shown}: {'PASS' if met else 'MISS'}"]


# ---- Main ----


def setup(args) -> Bench | None:
    if args.dry_run:
        vars(args).update(TINY)
        args.search = False
        device_ids, device = list(range(args.dry_run)), torch.device("cpu")
        args.batch_size = args.batch_size or 4 * args.dry_run
    elif not torch.cuda.is_available():
        return None
    else:
        device_ids, device = choose_devices(args), torch.device("cuda", 0)
        args.batch_size = args.batch_size or 8 * len(device_ids)
    n = len(device_ids)
    if args.batch_size % n:
        raise SystemExit(f"--batch_size {args.batch_size} must be a multiple of the {n} devices (device_ids).")
    args.max_batch = args.max_batch or 64 * n
    even = args.batch_size // n
    args.gpu0_bsz = args.gpu0_bsz or sorted({0, even // 4, even // 2})
    if any(not 0 <= g <= even for g in args.gpu0_bsz):
        raise SystemExit(
            f"--gpu0_bsz {args.gpu0_bsz}: each value must be in [0, {even}], GPU 0's even share of the per-step batch "
            f"({args.batch_size} rows on {n} devices); raise --batch_size for larger values."
        )
    return Bench(args, device_ids, device)


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = setup(args)
    if bench is None:
        print(
            "balance_gpu measures GPU memory and needs a CUDA GPU; none is visible here, so nothing was measured "
            f"(exit code {NO_GPU_EXIT}). Run it on a GPU machine, or `--dry_run 3` to check the script on CPU.",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    configs = [Config("stock transformers.Trainer", stock=True), Config("hf_parallel exact, even split", stock=False)]
    configs += [Config(f"hf_parallel gpu0_bsz={g}", stock=False, gpu0_bsz=g) for g in args.gpu0_bsz]
    with torch.device("meta"):  # the size only: no memory, no initialisation
        parameters = sum(p.numel() for p in LlamaForCausalLM(model_config(args)).parameters())
    print_workload(bench, parameters)
    results = [measure(config, bench) for config in configs]
    print_table(results, bench)
    print_analytic(bench)
    print("\nTargets:")
    print("\n".join(assess(results, bench)))
    failed = [r.config.label for r in results if r.failure not in (None, "out of memory")]
    if failed:
        print(f"\nFailed with an error (traceback on stderr): {', '.join(failed)}.", file=sys.stderr)
        return FAILED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
