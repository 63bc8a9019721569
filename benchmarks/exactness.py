"""
How far stock `transformers.Trainer` is from the exact loss, and how far `hf_parallel.Trainer` is, case by case
(the cases of the README's exact-loss section), measured in one run on CPU: torch's DataParallel on virtual CPU
devices (`hf_parallel.testing.simulate_data_parallel`), DDP with 2 real gloo ranks.

    python -m benchmarks.exactness 2>/dev/null   # all cases, DDP included (about a minute on 2 cores)
    python -m benchmarks.exactness --no-ddp

For each case: the logged loss and the gradient norm of one optimizer step, divided by those of one process on the
whole step (the reference), for stock and for hf_parallel; `eval_loss` likewise. Then the epoch remainder under
DDP: a 2-step epoch whose last step has fewer rows than the global batch, against one device on the same rows
(the last step's logged loss as a ratio, and the parameters after the epoch, off by what fraction of the update).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import warnings

import torch
import transformers

from tests.helpers.epochs import EPOCH, update_error
from tests.helpers.harness import SINGLE, TRAIN_ROWS, Topology, run_case, run_ddp, run_ddp_runs
from tests.helpers.heads import CASES

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


EPOCH_CASES = [
    # label, case, rows, per-device batch, gradient accumulation
    ("BERT cls, 10 rows, 2 ranks x 4", "bert_single_label", 10, 4, 1),
    ("BERT cls, 10 rows, 2 ranks x 2 x GA 2", "bert_single_label", 10, 2, 2),
    ("Llama LM, 10 rows, 2 ranks x 4", "llama_causal_lm", 10, 4, 1),
    ("BERT cls, 9 rows, 2 ranks x 4", "bert_single_label", 9, 4, 1),
]


def epoch_remainder() -> None:
    runs = {}
    for label, case, rows, per_device, accumulation in EPOCH_CASES:
        topology = Topology("DDP 2", per_device, accumulation, processes=2)
        for stock in (True, False):
            runs[(label, stock)] = (case, topology, stock, {"train_rows": rows, **EPOCH})
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ddp_runs(runs, tmp)
    title = "epoch remainder (vs one device on the same rows)"
    print(f"\n{title:<42} last-step loss  stock   exact | params off  stock   exact")
    for label, case, rows, _, _ in EPOCH_CASES:
        reference = run_case(case, Topology("one device", per_device=8), train_rows=rows, **EPOCH)
        initial = {n: p.detach() for n, p in CASES[case].build(0).named_parameters()}
        stock, ours = results[(label, True)], results[(label, False)]
        last = [r.losses[-1] / reference.losses[-1] for r in (stock, ours)]
        off = [update_error(r.params, reference.params, initial) for r in (stock, ours)]
        print(f"{label:<42} last-step loss {last[0]:7.3f} {last[1]:7.4f} | params off {off[0]:7.3f} {off[1]:7.1e}")


def grad_norm(result: dict) -> float:
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in result.grads.values()))


def row(label: str, reference: dict, stock: dict, ours: dict) -> None:
    cells = []
    for name, get in (("loss", lambda r: r.loss), ("grad", grad_norm), ("eval", lambda r: r.eval_loss)):
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
                f"{'':<42} stock trains in {stock.wrapped} (ranks {stock.max_rank_param_diff:.1e} apart), "
                f"hf_parallel in {ours.wrapped} ({ours.max_rank_param_diff:.1e} apart)"
            )
        epoch_remainder()


if __name__ == "__main__":
    main()
