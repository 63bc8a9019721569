"""
What one DataParallel training step brings to GPU 0, in bytes, measured on the CPU emulation of torch's DataParallel
(torch's own scatter, replicate, parallel_apply and gather; `hf_parallel.testing`): stock `transformers.Trainer`
against `hf_parallel.Trainer` with the even split and with `gpu0_bsz` 0 and 1, on a causal LM with a wide vocabulary.

    python -m benchmarks.gathered
    python -m benchmarks.gathered --vocab_size 32000 --devices 4

Bytes are those of every tensor the step's forward gathers on the output device (the per-row loss sums and item counts
for hf_parallel, the whole batch's logits and the per-replica loss vector for stock), next to the batch's fp32 logits.
"""

from __future__ import annotations

import argparse
import dataclasses

from tests.harness import TRAIN_ROWS, Topology, run_case
from tests.heads import SEQ, Case, llama, lm_rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--devices", type=int, default=3)
    args = parser.parse_args(argv)
    n = args.devices
    case = Case("llama_wide", lambda seed: llama(seed, vocab_size=args.vocab_size), lm_rows)
    per_device = -(-TRAIN_ROWS // n)
    batch = per_device * n
    even = Topology(f"DP {n}", per_device=per_device, dp_devices=n)
    configurations = {
        "stock transformers.Trainer": (even, True),
        "hf_parallel, even split": (even, False),
        "hf_parallel, gpu0_bsz=0": (dataclasses.replace(even, gpu0_bsz=0), False),
        "hf_parallel, gpu0_bsz=1": (dataclasses.replace(even, gpu0_bsz=1), False),
    }
    logits = batch * SEQ * args.vocab_size * 4
    print(f"{batch} rows x {SEQ} tokens per step, vocabulary {args.vocab_size}, {n} emulated devices")
    print(f"the batch's fp32 logits: {logits:,} bytes")
    stock = None
    for label, (topology, is_stock) in configurations.items():
        # The first step also checks the head against the model's own loss (its terms travel too): measure the
        # second step, as the difference between a 2-step and a 1-step run.
        first = run_case(case, topology, stock=is_stock, eval_rows=0, train_rows=2 * batch).emulation
        both = run_case(case, topology, stock=is_stock, eval_rows=0, train_rows=2 * batch, max_steps=2)
        emulation = both.emulation
        step_one, later = sum(first.gathered_bytes), sum(emulation.gathered_bytes) - sum(first.gathered_bytes)
        stock = later if stock is None else stock
        rows = dict.fromkeys(range(n), 0) | dict(
            zip(emulation.replica_devices, emulation.chunk_sizes[0], strict=False)
        )
        split = str(list(rows.values()))
        print(
            f"{label:<28} rows per device {split:<10} step 1: {step_one:>10,} bytes, step 2: {later:>10,} bytes "
            f"(x{later / stock:.5f} of stock)"
        )


if __name__ == "__main__":
    main()
