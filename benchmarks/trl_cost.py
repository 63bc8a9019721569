"""
The cost of TRL's trainers made exact: step time and peak memory of `class ParallelX(TrainerMixin, trl.X)` against
stock TRL's `X`, on the same workload, printed as median ratios (hf_parallel / stock).

    python -m benchmarks.trl_cost                 # SFT at a 128k vocabulary, DPO, GRPO; 2 rounds each
    python -m benchmarks.trl_cost --steps 2 --rounds 1 --memory-rounds 1

Workloads, built from configs (nothing downloaded): a 2-layer Llama with a 128,256-token vocabulary (Llama 3's),
trained by `SFTTrainer` on 8 rows of 96 tokens a step (gradient accumulation 2) through TRL's fused LM head, which
never builds the `[rows, positions, vocabulary]` logits (fp32: 8 x 96 x 128,256 x 4 B = 394 MB); and `DPOTrainer` on
the same model, 4 pairs a step (gradient accumulation 2), with its reference model; and `GRPOTrainer` (`dapo`) on 8
completions a step (two a prompt, 4 a micro-batch, gradient accumulation 2, one generation a step), each 32 tokens
across the vocabulary, made by a `rollout_func` (no sampling: the step's cost is TRL's loss, not generation).
hf_parallel calls TRL's own `compute_loss` (`hf_parallel.exact.heads.trainers`), so the fused head is kept; the step
adds a count of the step's items (one small all-reduce under DDP); GRPO's completions are generated before it.

Step time: the median over the timed steps of every round, stock and hf_parallel alternating. Peak memory: the peak
resident set size during training minus the resident size when it starts, each run in a fresh process with glibc
returning freed blocks at once (as `benchmarks.overhead` measures it), the median over `--memory-rounds`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

import torch
import transformers

from benchmarks.overhead import StepTimer, _peak, _reset_peak, _sides, parse_run_options, peak_in_fresh_process

VOCAB = 128_256
WORKLOADS = ("sft", "dpo", "grpo")
CONFIGS = {
    "sft": ("SFTTrainer", "SFTConfig"),
    "dpo": ("DPOTrainer", "DPOConfig"),
    "grpo": ("GRPOTrainer", "GRPOConfig"),
}


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _dataset(workload: str, rows: int):
    import datasets

    from tests.helpers.trl_runs import WORDS

    rng = random.Random(0)
    if workload == "sft":  # token ids across the whole vocabulary, as a real corpus uses it
        return datasets.Dataset.from_list([{"input_ids": [rng.randrange(4, VOCAB) for _ in range(96)]}] * rows)
    if workload == "grpo":
        return datasets.Dataset.from_list([{"prompt": " ".join(rng.choice(WORDS) for _ in range(24))}] * rows)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    return datasets.Dataset.from_list(
        [{"prompt": sentence(24), "chosen": sentence(24), "rejected": sentence(24)} for _ in range(rows)]
    )


def _rollout(prompts: list[str], trainer) -> dict:
    """32 completion tokens across the vocabulary a prompt, the same for every side (seeded by the prompt's place)."""
    prompt_ids = [trainer.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
    rows = [random.Random(i) for i in range(len(prompts))]
    return {"prompt_ids": prompt_ids, "completion_ids": [[r.randrange(4, VOCAB) for _ in range(32)] for r in rows],
            "logprobs": None}  # fmt: skip


def _reward(completions, **kwargs) -> list[float]:
    return [float(len(set(c))) for c in completions]


def run_once(stock: bool, workload: str, steps: int, warmup: int) -> tuple[list[float], int]:
    """One training run: the times of its steps after `warmup`, and its peak memory above the start (bytes)."""
    import trl

    from hf_parallel import TrainerMixin
    from tests.helpers.trl_runs import tokenizer

    name, config = CONFIGS[workload]
    trainer_cls = getattr(trl, name) if stock else type(f"Parallel{name}", (TrainerMixin, getattr(trl, name)), {})
    per_device = 2 if workload == "dpo" else 4
    own = {"max_length": None}
    if workload == "grpo":
        own = {"num_generations": 2, "max_completion_length": 32, "loss_type": "dapo"}
    with tempfile.TemporaryDirectory() as out:
        args = getattr(trl, config)(
            output_dir=out, max_steps=warmup + steps, per_device_train_batch_size=per_device,
            gradient_accumulation_steps=2, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
            disable_tqdm=True, logging_strategy="no", seed=0, **own,
        )  # fmt: skip
        extra = {}
        if workload == "dpo":
            extra = {"ref_model": _model(1)}
        if workload == "grpo":
            extra = {"reward_funcs": _reward, "rollout_func": _rollout}
        data = _dataset(workload, per_device * 2 * (warmup + steps))
        trainer = trainer_cls(
            model=_model(0), args=args, train_dataset=data, processing_class=tokenizer(), **extra
        )  # fmt: skip
        timer = StepTimer(warmup)
        trainer.add_callback(timer)
        trainer.remove_callback(transformers.PrinterCallback)
        base = _reset_peak()
        trainer.train()
        peak = _peak() - base
    return timer.times, peak


def measure_time(workload: str, steps: int, warmup: int, rounds: int) -> dict:
    times = {"stock": [], "hf_parallel": []}
    for r in range(rounds):
        for side in _sides(r):
            times[side] += run_once(side == "stock", workload, steps, warmup)[0]
    return {side: statistics.median(values) * 1e3 for side, values in times.items()}


def fresh_peak(side: str, workload: str) -> int:
    """Peak memory of one short run in a fresh process (see the module docstring)."""
    return peak_in_fresh_process("benchmarks.trl_cost", [side, workload])


def measure_memory(workload: str, rounds: int) -> dict:
    peaks = {"stock": [], "hf_parallel": []}
    for r in range(rounds):
        for side in _sides(r):
            peaks[side].append(fresh_peak(side, workload))
    return {side: statistics.median(values) / 2**20 for side, values in peaks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trl_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run (default 1)")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each side, interleaved (default 2)")
    parser.add_argument("--memory-rounds", type=int, default=2, help="fresh-process memory runs per side (default 2)")
    parser.add_argument("--memory-run", nargs=3, metavar=("SIDE", "WORKLOAD", "OUT"), help=argparse.SUPPRESS)
    options = parse_run_options(parser)
    if options.memory_run:
        side, workload, out = options.memory_run
        _, peak = run_once(side == "stock", workload, 1, 1)
        with open(out, "w") as file:
            file.write(str(peak))
        return
    import trl

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
    for workload in WORKLOADS:
        step = measure_time(workload, options.steps, options.warmup, options.rounds)
        peak = measure_memory(workload, options.memory_rounds)
        print(
            f"{workload:4s} step: stock {step['stock']:8.1f} ms, hf_parallel {step['hf_parallel']:8.1f} ms, "
            f"ratio {step['hf_parallel'] / step['stock']:.3f} | peak: stock {peak['stock']:7.1f} MiB, "
            f"hf_parallel {peak['hf_parallel']:7.1f} MiB, ratio {peak['hf_parallel'] / peak['stock']:.3f}"
        )


if __name__ == "__main__":
    main()
