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
from dataclasses import dataclass

from tests.helpers.harness import TRAIN_ROWS, Topology, run_case
from tests.helpers.heads import SEQ, Case, llama, lm_rows


@dataclass(frozen=True)
class StepBytes:
    """Bytes gathered on the output device by the first step (which also checks the head) and by the second."""

    first: int
    later: int
    split: list[int]  # rows per device, GPU 0 first


def configurations(devices: int) -> dict[str, tuple[Topology, bool]]:
    """Label -> (topology, stock) of the compared runs: stock, then hf_parallel even and with `gpu0_bsz` 0 and 1."""
    even = Topology(f"DP {devices}", per_device=-(-TRAIN_ROWS // devices), dp_devices=devices)
    return {
        "stock transformers.Trainer": (even, True),
        "hf_parallel, even split": (even, False),
        "hf_parallel, gpu0_bsz=0": (dataclasses.replace(even, gpu0_bsz=0), False),
        "hf_parallel, gpu0_bsz=1": (dataclasses.replace(even, gpu0_bsz=1), False),
    }


def step_bytes(vocab_size: int, topology: Topology, stock: bool) -> StepBytes:
    """The bytes of a causal LM's first and second DataParallel steps (a 2-step run less a 1-step run)."""
    case = Case("llama_wide", lambda seed: llama(seed, vocab_size=vocab_size), lm_rows)
    batch = topology.per_device * topology.dp_devices
    first = run_case(case, topology, stock=stock, eval_rows=0, train_rows=2 * batch).emulation
    both = run_case(case, topology, stock=stock, eval_rows=0, train_rows=2 * batch, max_steps=2).emulation
    rows = dict.fromkeys(range(topology.dp_devices), 0) | dict(
        zip(both.replica_devices, both.chunk_sizes[0], strict=False)
    )
    step_one = sum(first.gathered_bytes)
    return StepBytes(step_one, sum(both.gathered_bytes) - step_one, list(rows.values()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--devices", type=int, default=3)
    args = parser.parse_args(argv)
    n = args.devices
    batch = -(-TRAIN_ROWS // n) * n
    logits = batch * SEQ * args.vocab_size * 4
    print(f"{batch} rows x {SEQ} tokens per step, vocabulary {args.vocab_size}, {n} emulated devices")
    print(f"the batch's fp32 logits: {logits:,} bytes")
    stock = None
    for label, (topology, is_stock) in configurations(n).items():
        # The first step also checks the head against the model's own loss (its terms travel too): measure the
        # second step, as the difference between a 2-step and a 1-step run.
        measured = step_bytes(args.vocab_size, topology, is_stock)
        stock = measured.later if stock is None else stock
        print(
            f"{label:<28} rows per device {str(measured.split):<10} step 1: {measured.first:>10,} bytes, "
            f"step 2: {measured.later:>10,} bytes (x{measured.later / stock:.5f} of stock)"
        )


if __name__ == "__main__":
    main()
