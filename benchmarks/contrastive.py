"""
What the exact contrastive loss costs under gradient accumulation: step time and activation memory of
`hf_parallel.Trainer` (the cached two-pass, `contrastive_negatives="step"`) against stock `transformers.Trainer` (each
micro-batch scored against itself: not the loss of the step), and hf_parallel with `contrastive_negatives=
"micro_batch"` (stock's negatives), on the same CLIP workload, interleaved, printed as median ratios.

    python -m benchmarks.contrastive                       # CLIP (4 layers, width 128), 2 x 32 rows, 6 steps x 3
    python -m benchmarks.contrastive --steps 10 --rounds 5

Step time: the median over every timed optimizer step (the first step of each run is warm-up). Activation memory:
the peak, over a step, of the bytes autograd keeps for the backward (`torch.autograd.graph.saved_tensors_hooks`,
counted while a saved tensor is alive), which is what grows with the batch on a GPU; the two-pass's first pass runs
without autograd and keeps only the step's embeddings and their gradients (`[rows, dim]` each), reported apart.
On a GPU, compare `torch.cuda.max_memory_allocated` too; this CPU measure leaves the weights and optimizer out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import weakref

import torch
import transformers
from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

import hf_parallel

WIDTH, LAYERS, IMAGE, PATCH, TEXT, VOCAB = 128, 4, 64, 16, 32, 1000


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4)
    config = CLIPConfig(
        text_config=CLIPTextConfig(
            vocab_size=VOCAB, max_position_embeddings=TEXT, pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes
        ),
        vision_config=CLIPVisionConfig(image_size=IMAGE, patch_size=PATCH, **sizes),
        projection_dim=WIDTH,
    )
    return CLIPModel(config)


def rows(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(3, VOCAB, (TEXT,), generator=g),
            "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g),
        }
        for _ in range(n)
    ]


def collate(features: list[dict]) -> dict:
    return {**transformers.default_data_collator(features), "return_loss": True}


class SavedBytes:
    """The peak of the bytes autograd keeps for the backward while the block runs."""

    def __init__(self):
        self.live = self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        holder = _Holder(tensor)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._release, size)
        return holder

    def _release(self, size: int) -> None:
        self.live -= size

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor)


class _Holder:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Timer(transformers.TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


SIDES = {
    "stock": (transformers.Trainer, transformers.TrainingArguments, {}),
    "hf_parallel (step: two-pass)": (hf_parallel.Trainer, hf_parallel.TrainingArguments, {}),
    "hf_parallel (micro_batch)": (
        hf_parallel.Trainer,
        hf_parallel.TrainingArguments,
        {"contrastive_negatives": "micro_batch"},
    ),
}


def run(side: str, steps: int, batch: int) -> tuple[list[float], int]:
    trainer_cls, args_cls, extra = SIDES[side]
    timer, saved = _Timer(), SavedBytes()
    with tempfile.TemporaryDirectory() as tmp:
        args = args_cls(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=2,
            max_steps=steps,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            logging_steps=steps,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            **extra,
        )
        trainer = trainer_cls(
            model=build(), args=args, train_dataset=rows(2 * batch * steps), data_collator=collate, callbacks=[timer]
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        with saved.hooks():
            trainer.train()
    return timer.times[1:], saved.peak


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, the sides alternating")
    parser.add_argument("--batch", type=int, default=32, help="rows per micro-batch (2 micro-batches a step)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    times = {side: [] for side in SIDES}
    peaks = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            step_times, peak = run(side, args.steps, args.batch)
            times[side] += step_times
            peaks[side].append(peak)
    stock_time = statistics.median(times["stock"])
    stock_peak = statistics.median(peaks["stock"])
    cache = 2 * (2 * args.batch) * WIDTH * 4 * 2  # text and image embeddings of the step, and their gradients
    print(f"CLIP width {WIDTH}, {LAYERS} layers, 2 micro-batches of {args.batch} rows, {args.rounds} x {args.steps}")
    print(f"{'':32} {'step (s)':>10} {'x stock':>8} {'saved MiB':>10} {'x stock':>8}")
    result = {}
    for side in SIDES:
        median, peak = statistics.median(times[side]), statistics.median(peaks[side])
        result[side] = (median / stock_time, peak / stock_peak)
        print(f"{side:32} {median:10.3f} {median / stock_time:8.2f} {peak / 2**20:10.1f} {peak / stock_peak:8.2f}")
    print(f"the two-pass's cache (embeddings and their gradients): {cache / 2**20:.2f} MiB")
    return result


if __name__ == "__main__":
    main()
