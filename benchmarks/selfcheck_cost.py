"""
What the check of the head against the model's own loss (`hf_parallel.exact.check`) costs: the time of the first
micro-batch of a model (the check's forward without autograd, `calibrate_head`: the model's own loss and every
candidate head's sums, then the votes; then the micro-batch itself) over that of a micro-batch once the check has
decided (for this causal LM: the model's own loss, given the step's count), forward and backward through
`micro_batch_loss`, on a causal LM whose logits dominate (a wide vocabulary). Only the first step of a model pays it
(more only while a check cannot decide).

    python -m benchmarks.selfcheck_cost 2>/dev/null            # about a minute on 2 busy cores
    python -m benchmarks.selfcheck_cost --vocab 128256 --seq 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_parallel.exact import ExactLoss, RunContext, calibrate_head, count_step, micro_batch_loss


def _micro_batch(exact: ExactLoss, model, batch: dict) -> float:
    start = time.perf_counter()
    head = calibrate_head(exact, model, exact.head(model, batch), batch, RunContext())
    step = count_step(exact, head, [batch])
    loss, _ = micro_batch_loss(exact, model, head, batch, step, RunContext())
    loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    decided = ExactLoss()
    _micro_batch(decided, model, batch)  # its first micro-batch is checked; the later ones run as decided
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for checked in (False, True):
            model.zero_grad()
            times[checked].append(_micro_batch(ExactLoss() if checked else decided, model, batch))
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"causal LM, vocab {args.vocab}, {args.rows} x {args.seq} tokens: unchecked micro-batch {plain * 1e3:.0f} ms, "
        f"checked (with its check) {checked * 1e3:.0f} ms, ratio {checked / plain:.2f} (medians of {args.repeats})"
    )
    return checked / plain


if __name__ == "__main__":
    main()
