"""
What the exact MoE router loss costs under gradient accumulation: step time of `hf_parallel.Trainer` with
`router_balance="step"` (the default: one more forward without gradient per micro-batch gives the router statistics
of the whole step) against stock `transformers.Trainer` (each micro-batch's router term, added up: x the accumulation
steps) and hf_parallel with `router_balance="micro_batch"` (each micro-batch's term, averaged: warned), on the same
Mixtral workload, interleaved, printed as median ratios to stock.

    python -m benchmarks.router                       # Mixtral (4 layers, width 128, 8 experts top 2), GA 2 x 16 rows
    python -m benchmarks.router --steps 10 --rounds 5

It also prints each side's logged loss against the model's own loss in one forward over the step's rows (the step's
rows are the same on every side: no shuffling), so the ratio comes with what it buys. Step time: the median, over
every step but each run's first, of the time from one step's end to the next (the first pass runs before the Trainer's
`on_step_begin`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM

import hf_parallel

WIDTH, LAYERS, EXPERTS, TOP, SEQUENCE, VOCAB, COEF = 128, 4, 8, 2, 64, 1000, 0.5


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP,
        max_position_embeddings=SEQUENCE,
        output_router_logits=True,
        router_aux_loss_coef=COEF,
    )
    return MixtralForCausalLM(config)


def rows(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQUENCE,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


SIDES = {
    "stock": (transformers.Trainer, transformers.TrainingArguments, {}),
    "hf_parallel (step: first pass)": (hf_parallel.Trainer, hf_parallel.TrainingArguments, {}),
    "hf_parallel (micro_batch)": (
        hf_parallel.Trainer,
        hf_parallel.TrainingArguments,
        {"router_balance": "micro_batch"},
    ),
}


class _EndToEnd(transformers.TrainerCallback):
    """
    The time from one optimizer step's end to the next: all of a step, including what the Trainer does before its
    first micro-batch (`get_batch_samples`, where the first pass runs), which `on_step_begin` comes after.
    """

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    @property
    def times(self) -> list[float]:
        return [after - before for before, after in zip(self.ends[:-1], self.ends[1:], strict=True)]


class _NoShuffle:
    """Trainer mixin: the rows in order, so that the first step's rows are the dataset's first 2 x batch."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def run(side: str, steps: int, batch: int) -> tuple[list[float], float]:
    trainer_cls, args_cls, extra = SIDES[side]
    trainer_cls = type(f"Ordered{trainer_cls.__name__}", (_NoShuffle, trainer_cls), {})
    timer = _EndToEnd()
    with tempfile.TemporaryDirectory() as tmp:
        args = args_cls(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=2,
            max_steps=steps,
            learning_rate=1e-4,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            logging_steps=1,
            dataloader_num_workers=0,
            **extra,
        )
        trainer = trainer_cls(model=build(), args=args, train_dataset=rows(2 * batch * steps))
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.add_callback(timer)
        trainer.train()
        first_loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    return timer.times, first_loss


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, the sides alternating")
    parser.add_argument("--batch", type=int, default=16, help="rows per micro-batch (2 micro-batches a step)")
    args = parser.parse_args(argv)
    times = {side: [] for side in SIDES}
    losses = {}
    for _ in range(args.rounds):
        for side in SIDES:
            step_times, losses[side] = run(side, args.steps, args.batch)
            times[side] += step_times
    with torch.no_grad():
        own = build()(**transformers.default_data_collator(rows(2 * args.batch * args.steps)[: 2 * args.batch]))
    stock_time = statistics.median(times["stock"])
    print(
        f"Mixtral width {WIDTH}, {LAYERS} layers, {EXPERTS} experts top {TOP}, GA 2 x {args.batch} rows of "
        f"{SEQUENCE} tokens, {args.rounds} x {args.steps} steps"
    )
    print(f"{'':32} {'step (s)':>10} {'x stock':>8} {'first loss':>11} {'- own loss':>11}")
    result = {}
    for side in SIDES:
        median = statistics.median(times[side])
        off = losses[side] - own.loss.item()
        result[side] = (median / stock_time, off)
        print(f"{side:32} {median:10.3f} {median / stock_time:8.2f} {losses[side]:11.4f} {off:11.4f}")
    print(f"the model's own loss in one forward over the first step's rows: {own.loss.item():.4f}")
    return result


if __name__ == "__main__":
    main()
