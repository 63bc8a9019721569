"""
Stock `nn.DataParallel` against `BalancedDataParallel` at several `gpu0_bsz`, on a GPU machine: peak memory per GPU,
samples per second, and the largest batch that fits (GPU 0 being the limit), printed with ratios against stock.

    python -m benchmarks.balance_gpu                                   # all visible GPUs, defaults below
    python -m benchmarks.balance_gpu --batch_size 96 --gpu0_bsz 8 16 24 --budget_gib 24
    python -m benchmarks.balance_gpu --dry_run 3                       # no GPU: the same flow on 3 simulated devices

Exit codes: 0 after printing the figures; 2 without a CUDA GPU (nothing is measured; the message says so and points
to `--dry_run`). With one GPU, DataParallel runs over `device_ids=[0, 0]`: two replicas on the one GPU, the real
scatter / replicate / gather code path, but both "devices" share one memory, so per-device peaks cannot be told apart
(the script says so). `--dry_run N` runs on CPU through `hf_parallel.testing` (no memory figures, no largest batch):
a check that the script works, not a measurement.

The step is the one `hf_parallel.Trainer` runs with the exact loss: the wrapped model runs without labels, the loss
is computed once on the logits gathered on GPU 0 (a sum over rows divided by the batch size), then backward and an
AdamW step. The model is a BERT sequence classifier built from a config (nothing downloaded).

- Peak memory: `torch.cuda.max_memory_allocated(d)` for each GPU over `--steps` steps at `--batch_size`, after one
  warm-up step that allocates the optimizer state (on GPU 0, with the master weights and gradients).
- Samples/s: `--steps` timed steps after the warm-up, with `torch.cuda.synchronize()`.
- Largest batch: every GPU is capped at `--budget_gib` (`torch.cuda.set_per_process_memory_fraction`) and the
  largest per-step batch that completes a step without running out of memory is found by bisection, up to
  `--max_batch`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from hf_parallel import BalancedDataParallel, balanced_chunk_sizes
from hf_parallel.data_parallel import torch_chunk_sizes

NO_GPU_EXIT = 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch_size", type=int, default=0, help="per-step batch (default: 16 x the GPU count)")
    parser.add_argument(
        "--gpu0_bsz",
        type=int,
        nargs="+",
        default=None,
        help="values to try (default: 1/4, 1/2, 3/4 of GPU 0's even share)",
    )
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--num_layers", type=int, default=12)
    parser.add_argument("--num_labels", type=int, default=1000, help="a wide head makes the gathered logits count")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument(
        "--budget_gib", type=float, default=16.0, help="memory cap per GPU for the largest-batch search"
    )
    parser.add_argument("--max_batch", type=int, default=4096, help="upper end of the largest-batch search")
    parser.add_argument("--no_search", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--dry_run", type=int, default=0, metavar="N", help="CPU, N simulated devices, tiny model")
    return parser.parse_args(argv)


def build_model(args, device):
    torch.manual_seed(0)
    heads = max(1, args.hidden_size // 64)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=heads,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=max(512, args.seq_len),
        num_labels=args.num_labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).to(device)


def wrap(model, device_ids, gpu0_bsz, dry_run):
    if dry_run:
        from hf_parallel.testing import SimulatedBalancedDataParallel, SimulatedDataParallel

        if gpu0_bsz is None:
            return SimulatedDataParallel(model, device_ids=device_ids)
        return SimulatedBalancedDataParallel(model, device_ids=device_ids, gpu0_bsz=gpu0_bsz)
    if gpu0_bsz is None:
        return torch.nn.DataParallel(model, device_ids=device_ids)
    return BalancedDataParallel(model, device_ids=device_ids, gpu0_bsz=gpu0_bsz)


def step(wrapped, optimizer, batch_size, args, device):
    ids = torch.randint(1000, 30000, (batch_size, args.seq_len), device=device)
    labels = torch.randint(0, args.num_labels, (batch_size,), device=device)
    logits = wrapped(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum") / batch_size
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(devices):
    for d in devices:
        torch.cuda.synchronize(d)


def measure(label, gpu0_bsz, args, device_ids, device):
    """Peak memory per device and samples/s at args.batch_size; then the largest batch under the budget."""
    devices = sorted(set(device_ids)) if not args.dry_run else []
    model = build_model(args, device)
    wrapped = wrap(model, device_ids, gpu0_bsz, args.dry_run)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step(wrapped, optimizer, args.batch_size, args, device)  # warm-up: allocates the optimizer state
    synchronize(devices)
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    start = time.perf_counter()
    for _ in range(args.steps):
        step(wrapped, optimizer, args.batch_size, args, device)
    synchronize(devices)
    seconds = time.perf_counter() - start
    result = {
        "label": label,
        "split": (
            balanced_chunk_sizes(args.batch_size, len(device_ids), gpu0_bsz)
            if gpu0_bsz is not None
            else torch_chunk_sizes(args.batch_size, len(device_ids))
        ),
        "samples_per_s": args.steps * args.batch_size / seconds,
        "peaks_gib": [torch.cuda.max_memory_allocated(d) / 2**30 for d in devices],
        "largest_batch": None,
    }
    if not args.dry_run and not args.no_search:
        result["largest_batch"] = largest_batch(wrapped, optimizer, args, device)
    del wrapped, model, optimizer
    gc.collect()
    if not args.dry_run:
        torch.cuda.empty_cache()
    return result


def fits(wrapped, optimizer, batch_size, args, device):
    try:
        step(wrapped, optimizer, batch_size, args, device)
        return True
    except torch.OutOfMemoryError:
        pass
    # Outside the except block, so that the traceback (and the activations its frames hold) is gone.
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return False


def largest_batch(wrapped, optimizer, args, device):
    devices = sorted(set(wrapped.device_ids))
    for d in devices:  # the cap applies to the search only
        total = torch.cuda.get_device_properties(d).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * 2**30 / total), d)
    low, high = 0, args.max_batch + 1  # low fits (0 trivially), high does not (or is past the search)
    try:
        while high - low > 1:
            middle = (low + high) // 2
            if fits(wrapped, optimizer, middle, args, device):
                low = middle
            else:
                high = middle
    finally:
        for d in devices:
            torch.cuda.set_per_process_memory_fraction(1.0, d)
    return low


def report(results, device_ids, args):
    stock = results[0]
    print(
        f"\nbatch {args.batch_size}, device_ids {device_ids}, seq_len {args.seq_len}, hidden {args.hidden_size}, "
        f"{args.num_layers} layers, {args.num_labels} labels, {args.steps} timed steps"
    )
    if len(set(device_ids)) < len(device_ids) and not args.dry_run:
        print("One GPU: the replicas share its memory, so the per-device peaks below are the same figure.")
    header = f"{'wrapper':<24}{'split':<24}{'samples/s':>10}{'ratio':>7}"
    peaks_shown = bool(stock["peaks_gib"])
    if peaks_shown:
        header += "  peak GiB per GPU (ratio to stock)"
    print(header)
    for r in results:
        line = f"{r['label']:<24}{str(r['split']):<24}{r['samples_per_s']:>10.1f}"
        line += f"{r['samples_per_s'] / stock['samples_per_s']:>7.2f}"
        if peaks_shown:
            line += "  " + ", ".join(
                f"{p:.2f} ({p / s:.2f})" for p, s in zip(r["peaks_gib"], stock["peaks_gib"], strict=True)
            )
        print(line)
    if stock["largest_batch"] is not None:
        print(f"\nlargest per-step batch with every GPU capped at {args.budget_gib} GiB:")
        for r in results:
            print(
                f"{r['label']:<24}{r['largest_batch']:>8}  ({r['largest_batch'] / max(1, stock['largest_batch']):.2f}"
                " x stock)"
            )


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        device_ids = list(range(args.dry_run))
        args.hidden_size, args.num_layers, args.seq_len, args.num_labels = 32, 1, 16, 8
        args.steps = min(args.steps, 2)
    elif not torch.cuda.is_available():
        print(
            "balance_gpu.py measures GPU memory and needs a CUDA GPU; none is visible here, so nothing was measured "
            f"(exit code {NO_GPU_EXIT}). Run it on a GPU machine, or `--dry_run 3` to check the script on CPU.",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    else:
        device = torch.device("cuda", 0)
        count = torch.cuda.device_count()
        device_ids = list(range(count)) if count > 1 else [0, 0]
    n = len(device_ids)
    if args.batch_size <= 0:
        args.batch_size = 16 * n
    even = args.batch_size // n
    gpu0_values = args.gpu0_bsz or sorted({max(0, even * k // 4) for k in (1, 2, 3)})
    configs = [("stock nn.DataParallel", None)] + [(f"balanced gpu0_bsz={g}", g) for g in gpu0_values]
    results = [measure(label, g, args, device_ids, device) for label, g in configs]
    report(results, device_ids, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
