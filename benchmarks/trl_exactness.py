"""
TRL's trainers split, stock TRL next to hf_parallel's mixin: how far each is from the whole step in one micro-batch
on one process (TRL's own rule, that the splits "should yield the same results").

    python -m benchmarks.trl_exactness 2>/dev/null

Each case trains one epoch of the rows, in order, with plain SGD in fp32 (tests/helpers/trl_runs.py `train_split`),
from the same tiny Llama; `eval_loss` at the initial weights in batches of 2 (one process) or 3 a rank (DDP) against
the whole set in one batch. Figures: the largest relative error of a step's logged loss, the update's error relative
to the largest change the whole step made, the relative error of `eval_loss`, and for SFT, DPO and the reward model
the largest error of a step's logged metric (`METRICS`) relative to its size.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch
import transformers

from hf_parallel import TrainerMixin
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.epochs import update_error

#: case: (trainer, its settings, rows, the split: per-device rows, accumulation, evaluation batch; 2 DDP ranks).
CASES = {
    "SFT, 5 rows as micro-batches of 2 + 2 + 1": ("SFTTrainer", {}, 5, 2, 3, 2, False),
    "DPO, 5 pairs as 2 + 2 + 1": ("DPOTrainer", {}, 5, 2, 3, 2, False),
    "DPO with its sft term (weight 0.5), 5 pairs as 2 + 2 + 1": (
        "DPOTrainer",
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
        5,
        2,
        3,
        2,
        False,
    ),  # fmt: skip
    "reward model, 5 pairs as 2 + 2 + 1": ("RewardTrainer", {"center_rewards_coefficient": 0.1}, 5, 2, 3, 2, False),
    "SFT, 2 DDP ranks, 10 rows in steps of 4": ("SFTTrainer", {}, 10, 2, 1, 3, True),
    "DPO, 2 DDP ranks, 10 pairs in steps of 4": ("DPOTrainer", {}, 10, 2, 1, 3, True),
    "reward model, 2 DDP ranks, the same": ("RewardTrainer", {"center_rewards_coefficient": 0.1}, 10, 2, 1, 3, True),
    "SFT on a Mixtral (router term), 5 rows as 2 + 2 + 1": ("SFTTrainer", {"moe": True}, 5, 2, 3, 2, False),
    "DPO on a Mixtral (router term), 5 pairs as 2 + 2 + 1": ("DPOTrainer", {"moe": True}, 5, 2, 3, 2, False),
    "KTO (beta 1), 5 rows as 2 + 2 + 1": ("KTOTrainer", {"beta": 1.0}, 5, 2, 3, 2, False),
    "KTO, 2 DDP ranks, 10 rows in steps of 4": ("KTOTrainer", {"beta": 1.0}, 10, 2, 1, 3, True),
    # GRPO: rows are prompts, 2 completions each (fixed: the same under every split); batches count completions
    "GRPO bnpo, 8 prompts, steps of 4 completions as 2 + 2": ("GRPOTrainer", {"loss_type": "bnpo"}, 8, 2, 2, 6, False),
    "GRPO dapo, generation every micro-batch, steps of 2 + 2": (
        "GRPOTrainer",
        {"loss_type": "dapo", "steps_per_generation": 1},
        8,
        2,
        2,
        6,
        False,
    ),  # fmt: skip
    "GRPO dapo, a generation for 2 steps, first step 2 + 2": (
        "GRPOTrainer",
        {"loss_type": "dapo", "steps_per_generation": 4, "max_steps": 1},
        8,
        2,
        2,
        6,
        False,
    ),  # fmt: skip
    "GRPO bnpo, 2 DDP ranks, 10 prompts, steps of 4 completions": (
        "GRPOTrainer",
        {"loss_type": "bnpo"},
        10,
        2,
        1,
        2,
        True,
    ),  # fmt: skip
}


def _classes(trl, name: str) -> dict:
    stock = getattr(trl, name)
    return {"stock": stock, "hf_parallel": type(f"Parallel{name}", (TrainerMixin, stock), {})}


def _split_runs(cases: dict, out_dir: str) -> dict:
    """Every split run of `cases`, stock and hf_parallel (in each DDP rank, rank 0's results)."""
    import trl
    from accelerate.state import AcceleratorState

    from tests.helpers.trl_runs import train_split

    torch.set_num_threads(1 if torch.distributed.is_initialized() else torch.get_num_threads())
    runs = {}
    for case, (name, settings, rows, per_device, accumulation, eval_batch, _) in cases.items():
        for side, cls in _classes(trl, name).items():
            split = {"per_device": per_device, "accumulation": accumulation, "eval_batch": eval_batch}
            runs[case, side] = train_split(
                trl, name, cls, str(Path(out_dir) / f"{len(runs)}"), rows=rows, settings=settings, **split
            )
            AcceleratorState._reset_state()
    return runs


def _ranks_worker(cases: dict, out_dir: str) -> None:
    runs = _split_runs(cases, out_dir)
    if torch.distributed.get_rank() == 0:
        torch.save(runs, Path(out_dir) / "runs.pt")


#: TRL's logged metrics hf_parallel makes the whole step's (hf_parallel.exact.heads.trainers), per trainer.
METRICS = {
    "SFTTrainer": ("mean_token_accuracy", "entropy"),
    "DPOTrainer": ("rewards/accuracies", "rewards/margins", "rewards/chosen", "logps/chosen"),
    "RewardTrainer": ("accuracy", "margin", "mean_reward"),
}


def _errors(run: dict, whole: dict, initial: dict, name: str) -> tuple[float, ...]:
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], whole["losses"], strict=True))
    update = update_error(run["weights"], whole["weights"], initial)
    errors = (loss, update, abs(run["eval_loss"] - whole["eval_loss"]) / abs(whole["eval_loss"]))
    if name not in METRICS:
        return errors
    # every step's logged metric, the largest error relative to the metric's largest size over the steps
    metric = 0.0
    for key in METRICS[name]:
        theirs = [log[key] for log in whole["logs"]]
        mine = [log[key] for log in run["logs"]]
        size = max(abs(v) for v in theirs) or 1.0
        metric = max(metric, *(abs(a - b) / size for a, b in zip(mine, theirs, strict=True)))
    return (*errors, metric)


def measure() -> list[tuple[str, tuple[float, ...], tuple[float, ...]]]:
    """Per case: stock TRL's and hf_parallel's (loss, update, eval_loss) errors against the whole step."""
    import trl

    from tests.helpers.trl_runs import CASES as TRAINERS
    from tests.helpers.trl_runs import moe_lm, train_split

    with tempfile.TemporaryDirectory() as out:
        runs = _split_runs({k: v for k, v in CASES.items() if not v[-1]}, out)
        ranked = {k: v for k, v in CASES.items() if v[-1]}
        spawn_cpu_ranks(_ranks_worker, args=(ranked, out), num_processes=2, timeout=600)
        runs.update(torch.load(Path(out) / "runs.pt", weights_only=False))
        rows = []
        for case, (name, settings, n, per_device, *_) in CASES.items():
            # KTO's KL pairs (another row's completion) are made in chunks of the per-device batch: the split's.
            pairs = {"kl_pairs": per_device} if name == "KTOTrainer" else {}
            evaluation = n
            if name == "GRPOTrainer":  # the whole step's completions generated at once; the set's 2 a prompt
                settings, evaluation = {**settings, "steps_per_generation": 1}, 2 * n
            whole = train_split(
                trl, name, getattr(trl, name), str(Path(out) / "whole"), rows=n, per_device=n if n <= 5 else 4,
                eval_batch=evaluation, settings=settings, **pairs,
            )  # fmt: skip
            initial = (moe_lm if settings.get("moe") else TRAINERS[name].model)(0).state_dict()
            errors = [_errors(runs[case, side], whole, initial, name) for side in ("stock", "hf_parallel")]
            rows.append((case, *errors))
    return rows


def main() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import trl

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
    print("| case | stock TRL: loss / update / eval_loss / logged metrics off by | hf_parallel's mixin |")
    print("|---|---|---|")
    for case, stock, ours in measure():
        print(f"| {case} | {' / '.join(f'{e:.1e}' for e in stock)} | {' / '.join(f'{e:.1e}' for e in ours)} |")


if __name__ == "__main__":
    main()
