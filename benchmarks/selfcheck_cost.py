"""
What the self-check against the model's own loss (`hf_parallel.exact.selfcheck`) costs: the time of the one
micro-batch that is checked (the model also computes its own loss, every candidate head its terms, then the votes)
over that of a micro-batch that is not, forward and backward, on a causal LM whose logits dominate (a wide
vocabulary). Only the first micro-batch of a model pays it (more only while a check cannot decide).

    python -m benchmarks.selfcheck_cost 2>/dev/null            # about a minute on 2 busy cores
    python -m benchmarks.selfcheck_cost --vocab 128256 --seq 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_parallel.exact import ExactLoss
from hf_parallel.exact.selfcheck import decide


def _micro_batch(exact: ExactLoss, model, batch: dict, checked: bool) -> float:
    start = time.perf_counter()
    head = exact.head(model, batch)
    candidates = exact.pending_check(head, model, batch) if checked else None
    inputs, labels = exact.split_labels(head, batch, model)
    outputs = model(**inputs, **labels) if checked else model(**inputs)
    terms = exact.terms(head, outputs, labels, inputs)
    if checked:
        terms.update(exact.check_terms(candidates, outputs, labels, inputs, terms))
        decide(candidates, terms)
    exact.reduce(head, terms, None).backward()
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
    exact = ExactLoss()
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for checked in (False, True):
            model.zero_grad()
            times[checked].append(_micro_batch(exact, model, batch, checked))
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"causal LM, vocab {args.vocab}, {args.rows} x {args.seq} tokens: unchecked micro-batch {plain * 1e3:.0f} ms, "
        f"checked {checked * 1e3:.0f} ms, ratio {checked / plain:.2f} (medians of {args.repeats})"
    )
    return checked / plain


if __name__ == "__main__":
    main()
