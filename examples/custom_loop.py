"""Train a causal LM with your own accelerate loop, and keep its loss exact: `hf_parallel.ExactLoop`.

accelerate's canonical loop back-propagates `model(**batch).loss`, each micro-batch's mean over its own valid tokens,
and `accelerator.accumulate` / DDP average those means over the micro-batches and the processes. The batches of a
causal LM hold uneven numbers of valid tokens (and under DDP the last batch of an epoch is padded with repeated
rows), so that is neither the loss of the optimizer step nor its gradient. The lines marked `# hf_parallel:` in
`train_exact` (next to `train_stock`, the canonical loop they replace) make both equal to one device's on the whole
step. With no arguments: a tiny Llama built from a config, on counting sequences made in code (3 to 24 valid tokens
per row, padded with -100 labels); nothing is downloaded, a few seconds on a CPU.

One process (the CPU, or one GPU):

    python examples/custom_loop.py
    python examples/custom_loop.py --per_device_batch_size 4 --gradient_accumulation_steps 2   # the same numbers
    python examples/custom_loop.py --per_device_batch_size 4 --gradient_accumulation_steps 2 --stock   # not

2 processes on a machine without GPUs (DDP over gloo; the config's MULTI_GPU type is what makes accelerate start
several processes, and without GPUs the script joins them on the CPU):

    accelerate launch --config_file hf_parallel/configs/cpu_ddp.yaml examples/custom_loop.py --use_cpu \
        --per_device_batch_size 4
    torchrun --nproc_per_node 2 examples/custom_loop.py --use_cpu --per_device_batch_size 4

One process per GPU (NCCL):

    accelerate launch --config_file hf_parallel/configs/multi_gpu.yaml --num_processes 2 examples/custom_loop.py \
        --per_device_batch_size 4
    torchrun --nproc_per_node 2 examples/custom_loop.py --per_device_batch_size 4

Every run with the same global batch (per-device batch x accumulation steps x processes; 8 above) prints the same
per-step losses and evaluation loss, to float rounding. Add `--stock` to any of them to see the canonical loop's.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from hf_parallel import ExactLoop, release_distributed

VOCAB, MAX_LENGTH = 64, 24


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per_device_batch_size", type=int, default=8, help="Rows per process and micro-batch.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Micro-batches per step.")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=0.5, help="Plain SGD: the update is the gradient.")
    parser.add_argument("--train_rows", type=int, default=20, help="20 rows, global batch 8: a padded last step.")
    parser.add_argument("--eval_rows", type=int, default=13)
    parser.add_argument("--eval_batch_size", type=int, default=4, help="Rows per process in evaluation.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stock", action="store_true", help="Train on outputs.loss, as the canonical loop does.")
    parser.add_argument(
        "--use_cpu", action="store_true", help="Run on the CPU even where there are GPUs (without, it does anyway)."
    )
    return parser.parse_args(argv)


def make_rows(n: int, seed: int) -> list[dict]:
    """Counting sequences (start, start + k, start + 2k, ... modulo the vocabulary) of 3 to 24 valid tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (1,), generator=g).item()
        stride = torch.randint(1, 4, (1,), generator=g).item()
        length = torch.randint(3, MAX_LENGTH + 1, (1,), generator=g).item()
        ids = (start + stride * torch.arange(MAX_LENGTH)) % VOCAB
        mask = (torch.arange(MAX_LENGTH) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
    )
    return LlamaForCausalLM(config)


def train_exact(accelerator, model, optimizer, train_dataloader, eval_dataloader, epochs: int) -> float:
    exact = ExactLoop(accelerator)  # hf_parallel: new
    number = 0
    for _ in range(epochs):
        model.train()
        for step in exact.steps(train_dataloader):  # hf_parallel: was `for batch in train_dataloader:`
            for batch in step:  # hf_parallel: new, the step's micro-batches (all counted before the first runs)
                with accelerator.accumulate(model):
                    loss = step.loss(model, batch)  # hf_parallel: was `loss = model(**batch).loss`
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            number += 1
            logged = step.logged_loss()  # hf_parallel: was the mean of `accelerator.reduce(loss, "mean")`
            accelerator.print(f"step {number}: loss {logged:.6f}")
    return exact.evaluate(model, eval_dataloader)  # hf_parallel: was the loop of `train_stock` below


def train_stock(accelerator, model, optimizer, train_dataloader, eval_dataloader, epochs: int) -> float:
    number, losses = 0, []
    for _ in range(epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean"))
            if accelerator.sync_gradients:  # the optimizer stepped: log the mean over micro-batches and processes
                number += 1
                accelerator.print(f"step {number}: loss {torch.stack(losses).mean().item():.6f}")
                losses = []
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(len(batch["input_ids"]))))
    return torch.cat(losses).mean().item()


def train(args: argparse.Namespace) -> None:
    accelerator = Accelerator(
        cpu=args.use_cpu or not torch.cuda.is_available(),  # without GPUs, launched processes join one gloo group
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise SystemExit(f"{launched} processes were launched but {accelerator.num_processes} train together.")
    global_batch = args.per_device_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    accelerator.print(
        f"processes: {accelerator.num_processes}, global batch: {global_batch} ({args.per_device_batch_size} rows x "
        f"{args.gradient_accumulation_steps} micro-batches x {accelerator.num_processes} processes), "
        f"loss: {'stock outputs.loss' if args.stock else 'exact'}"
    )
    model = tiny_llama(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    shuffle = torch.Generator().manual_seed(args.seed)
    train_dataloader = DataLoader(
        make_rows(args.train_rows, seed=1), batch_size=args.per_device_batch_size, shuffle=True, generator=shuffle
    )
    eval_dataloader = DataLoader(make_rows(args.eval_rows, seed=2), batch_size=args.eval_batch_size)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    run = train_stock if args.stock else train_exact
    eval_loss = run(accelerator, model, optimizer, train_dataloader, eval_dataloader, args.epochs)
    accelerator.print(f"eval loss {eval_loss:.6f}")
    accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))
    # The DDP wrapper and the process group go before the interpreter's teardown, where gloo can abort.
    release_distributed()


if __name__ == "__main__":
    main()
