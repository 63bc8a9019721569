"""Sequences per second of `hf_parallel.embed_dataset`: 1 process vs 2-rank DDP on CPU, vs a plain loop.

Run from the repository root:

    python -m benchmarks.embed                      # defaults: 512 chunks of 64 bases, batch 32, 3 repeats
    python -m benchmarks.embed --num_sequences 2048 --hidden_size 256 --repeats 5
    python -m benchmarks.embed --threads 1          # 1 process on 1 thread; each DDP rank gets 1 thread anyway

Three timings of the same job (a tiny BERT masked LM built from a config, random DNA chunks, mean pooling):

- `loop`: a plain single-process loop: `for batch in loader`, the full masked LM forward with
  `output_hidden_states=True`, per-row masked mean, results kept in a list. No file, no gathering.
- `embed 1 proc`: `embed_dataset` in this process, writing a .npy.
- `embed DDP x2`: `embed_dataset` on 2 ranks (gloo, `hf_parallel.testing.spawn_cpu_ranks`), rank 0 writing the .npy.

Each prints the median of `--repeats` runs (model and data built once, outside the timing). The two single-process
timings use all of torch's threads; each DDP rank gets `threads // 2`, so on a 2-core machine DDP has no extra
hardware to gain from, and its ratio shows the cost of the gathering and the process split. Figures on a shared
machine are noisy: compare ratios from the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from examples.embed import char_tokenizer
from hf_parallel import embed_dataset
from hf_parallel.testing import spawn_cpu_ranks


def build(args):
    tokenizer = char_tokenizer()
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=4,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=args.chunk_size + 2,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = BertForMaskedLM(config).eval()
    rng = np.random.default_rng(0)
    # Chunks of chunk_size bases, the last of each read shorter, so batches are padded as in the example.
    lengths = rng.integers(args.chunk_size // 2, args.chunk_size + 1, size=args.num_sequences)
    seqs = ["".join(rng.choice(list("ACGT"), size=n)) for n in lengths]
    enc = tokenizer(seqs)
    rows = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i]} for i in range(len(seqs))]
    return model, tokenizer, rows


def plain_loop(model, tokenizer, rows, batch_size) -> np.ndarray:
    loader = torch.utils.data.DataLoader(
        rows, batch_size=batch_size, collate_fn=lambda b: tokenizer.pad(b, return_tensors="pt")
    )
    results = []
    with torch.inference_mode():
        for batch in loader:
            states = model(**batch, output_hidden_states=True).hidden_states[-1]
            mask = batch["attention_mask"].unsqueeze(-1).float()
            results.append((states * mask).sum(1) / mask.sum(1))
    return torch.cat(results).numpy()


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def ddp_worker(args, out_dir: str, threads: int):
    import torch.distributed as dist
    from accelerate import PartialState

    torch.set_num_threads(threads)
    state = PartialState(cpu=True)
    assert state.num_processes == 2, state
    model, tokenizer, rows = build(args)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        embed_dataset(
            model,
            rows,
            batch_size=args.batch_size,
            tokenizer=tokenizer,
            output_file=Path(out_dir) / "ddp.npy",
            progress=False,
        )
        times.append(time.perf_counter() - start)
    if state.is_main_process:
        np.save(Path(out_dir) / "ddp_times.npy", np.array(times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_sequences", type=int, default=512)
    parser.add_argument("--chunk_size", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the single process (default: torch's choice)."
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(
        f"{args.num_sequences} sequences of <= {args.chunk_size} bases, batch {args.batch_size}, BERT "
        f"{args.num_layers}x{args.hidden_size}, {threads} torch threads, median of {args.repeats}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        # Each rank gets its share of the cores; OMP_NUM_THREADS so that PartialState keeps that thread count.
        rank_threads = max(1, threads // 2)
        os.environ["OMP_NUM_THREADS"] = str(rank_threads)
        spawn_cpu_ranks(ddp_worker, (args, tmp, rank_threads), 2)
        ddp_time = float(np.median(np.load(Path(tmp) / "ddp_times.npy")))
        ddp_out = np.load(Path(tmp) / "ddp.npy")

        model, tokenizer, rows = build(args)
        loop_time, loop_out = timed(lambda: plain_loop(model, tokenizer, rows, args.batch_size), args.repeats)
        one_time, one_out = timed(
            lambda: np.asarray(
                embed_dataset(
                    model,
                    rows,
                    batch_size=args.batch_size,
                    tokenizer=tokenizer,
                    output_file=Path(tmp) / "one.npy",
                    progress=False,
                )
            ),
            args.repeats,
        )

    n = args.num_sequences
    for name, out in (("embed 1 proc", one_out), ("embed DDP x2", ddp_out)):
        diff = float(np.abs(out - loop_out).max())
        assert out.shape == loop_out.shape and diff < 1e-4, (name, out.shape, diff)
    print(f"{'loop':<14}{n / loop_time:10.1f} seq/s   ({loop_time:.3f} s)")
    print(f"{'embed 1 proc':<14}{n / one_time:10.1f} seq/s   ({one_time:.3f} s)   x{loop_time / one_time:.2f} vs loop")
    print(
        f"{'embed DDP x2':<14}{n / ddp_time:10.1f} seq/s   ({ddp_time:.3f} s)   x{loop_time / ddp_time:.2f} vs loop, "
        f"x{one_time / ddp_time:.2f} vs 1 proc"
    )
    print("All three give the same embeddings (max |diff| < 1e-4), one row per sequence, in order.")


if __name__ == "__main__":
    main()
