"""
How far stock `transformers.Trainer` is from the exact loss, and how far `hf_parallel.Trainer` is, case by case
(the table of DESIGN.md), measured in one run on CPU: DataParallel through the CPU simulation, DDP with 2 real
gloo ranks.

    python -m benchmarks.exactness 2>/dev/null   # all cases, DDP included (about a minute on 2 cores)
    python -m benchmarks.exactness --no-ddp

For each case: the logged loss and the gradient norm of one optimizer step, divided by those of one process on the
whole step (the reference), for stock and for hf_parallel; `eval_loss` likewise.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import warnings

import torch
import transformers

from tests.equivalence import SINGLE, TRAIN_ROWS, Topology, run_case, run_ddp

DDP2 = Topology("DDP 2 ranks", per_device=TRAIN_ROWS // 2, processes=2)
# (label, case, topology, training rows, extra TrainingArguments)
IN_PROCESS = [
    ("BERT cls, grad-accum 2", "bert_single_label", Topology("GA 2", per_device=4, accumulation=2), 8, {}),
    ("BERT cls, DP split [2,1]", "bert_single_label", Topology("DP 2", per_device=2, dp_devices=2), 3, {}),
    ("BERT cls, DP 5 rows on 4 GPUs", "bert_single_label", Topology("DP 4", per_device=2, dp_devices=4), 5, {}),
    ("Llama LM, DP 5 rows on 4 GPUs", "llama_causal_lm", Topology("DP 4", per_device=2, dp_devices=4), 5, {}),
    ("BERT cls + label smoothing 0.1, DP 2", "bert_single_label_smoothing", Topology("DP 2", 4, dp_devices=2), 8, {}),
    ("GPT-2 LM, one process", "gpt2_causal_lm", SINGLE, 8, {}),
    ("BERT masked LM (eval_loss), one process", "bert_masked_lm", SINGLE, 8, {}),
]
DDP = [
    ("BERT cls, DDP 2 ranks", "bert_single_label", {"evaluate_first": False}),
    (
        "Llama LM, DDP 2, averaging off",
        "llama_causal_lm",
        {"average_tokens_across_devices": False, "evaluate_first": False},
    ),
    ("BERT cls, DDP 2, evaluate() before train()", "bert_single_label", {}),
]


def grad_norm(result: dict) -> float:
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in result["grads"].values()))


def row(label: str, reference: dict, stock: dict, ours: dict) -> None:
    cells = []
    for name, get in (("loss", lambda r: r["loss"]), ("grad", grad_norm), ("eval", lambda r: r["eval_loss"])):
        ref = get(reference) or float("nan")
        cells.append(f"{name} {get(stock) / ref:7.3f} {get(ours) / ref:7.4f}")
    print(f"{label:<42} " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-rank DDP cases")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONWARNINGS"] = "ignore"  # the DDP ranks are fresh processes
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    header = " | ".join(f"{name}   stock   exact" for name in ("loss", "grad", "eval"))
    print(f"{'case (ratio to one process on the whole step)':<42} {header}")
    for label, case, topology, rows, extra in IN_PROCESS:
        reference = run_case(case, SINGLE, train_rows=rows)
        stock = run_case(case, topology, stock=True, train_rows=rows, **extra)
        ours = run_case(case, topology, train_rows=rows, **extra)
        row(label, reference, stock, ours)
    if not options.no_ddp:
        for label, case, extra in DDP:
            # The reference evaluates at the same point (before or after the step) as the run it is compared with.
            reference = run_case(case, SINGLE, evaluate_first=extra.get("evaluate_first", True))
            with tempfile.TemporaryDirectory() as tmp:
                stock = run_ddp([case], DDP2, tmp, stock=True, **extra)[case]
            with tempfile.TemporaryDirectory() as tmp:
                ours = run_ddp([case], DDP2, tmp, **extra)[case]
            row(label, reference, stock, ours)
            print(
                f"{'':<42} stock trains in {stock['wrapped']} (ranks {stock['max_rank_param_diff']:.1e} apart), "
                f"hf_parallel in {ours['wrapped']} ({ours['max_rank_param_diff']:.1e} apart)"
            )


if __name__ == "__main__":
    main()
