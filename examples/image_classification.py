"""Train an image classifier (ViT) with `hf_parallel.Trainer`, evaluate, save, reload, and check the reload.

With no arguments it trains a tiny ViT built from a config (32x32 images, 8x8 patches) on synthetic images made in
code: a bright square on a noisy background, in the left, middle or right third of the image (3 classes). On CPU it
takes seconds and reaches an eval accuracy above 0.9. Every `TrainingArguments` flag works
(`--per_device_train_batch_size`, `--num_train_epochs`, `--output_dir`, `--gpu0_bsz`, `--exact_loss`, ...), plus
the flags below (`--help` lists all).

One process (CPU, or one GPU; several GPUs without a launcher use DataParallel):

    python examples/image_classification.py
    python examples/image_classification.py --model_name_or_path google/vit-base-patch16-224-in21k \\
        --learning_rate 5e-5 --num_train_epochs 3

DDP over the GPUs of one machine (one process per GPU), or over 2 CPU processes on a machine without GPUs (the
processes need `--use_cpu`: accelerate does not pass the config's `use_cpu` on, and without it the Trainer stops):

    accelerate launch --config_file hf_parallel/configs/multi_gpu.yaml --num_processes 4 \\
        examples/image_classification.py
    accelerate launch --config_file hf_parallel/configs/cpu_ddp.yaml examples/image_classification.py --use_cpu

With `--model_name_or_path`, the synthetic images are drawn at the model's `image_size` and scaled to [-1, 1] (the
normalisation of the ViT checkpoints); the classifier head is new (`num_labels=3`). For your own images, build the
`pixel_values` with the checkpoint's `AutoImageProcessor` (it needs Pillow) instead of `synthetic_squares`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (
    AutoModelForImageClassification,
    HfArgumentParser,
    ViTConfig,
    ViTForImageClassification,
    set_seed,
)

from hf_parallel import Trainer, TrainingArguments, check_reload, release_distributed

CLASSES = ["left", "middle", "right"]


@dataclass
class ScriptArguments:
    # Parameters that control the model
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A hub model id or a local folder. Default: a tiny ViT built from a config (no download)."},
    )
    # Parameters that control the data
    num_train_images: int = field(default=1000, metadata={"help": "Synthetic training images."})
    num_eval_images: int = field(default=150, metadata={"help": "Synthetic evaluation images."})
    noise: float = field(default=0.2, metadata={"help": "Standard deviation of the pixel noise (pixels in [0, 1])."})


def synthetic_squares(num_images: int, image_size: int, noise: float, seed: int) -> list[dict[str, torch.Tensor]]:
    """
    Images of a bright square in the left, middle or right third (the label: 0, 1, 2), at a random height, of a
    random size and colour, on a dark background with Gaussian noise; channels first, scaled to [-1, 1].
    """
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_images):
        label = int(rng.integers(len(CLASSES)))
        side = int(rng.integers(image_size // 5, image_size // 4 + 1))
        third = image_size // 3
        left = label * third + int(rng.integers(0, max(third - side, 0) + 1))
        top = int(rng.integers(0, image_size - side + 1))
        image = np.full((3, image_size, image_size), rng.uniform(0.0, 0.3), dtype=np.float32)
        image[:, top : top + side, left : left + side] = rng.uniform(0.6, 1.0, size=(3, 1, 1))
        image += rng.normal(0.0, noise, size=image.shape).astype(np.float32)
        pixels = (np.clip(image, 0.0, 1.0) - 0.5) / 0.5
        rows.append({"pixel_values": torch.from_numpy(pixels), "labels": torch.tensor(label)})
    return rows


def tiny_config(**overrides) -> ViTConfig:
    """The default model: a 2-layer ViT on 32x32 images cut in 16 patches of 8x8, trained in seconds on 2 cores."""
    settings = dict(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=len(CLASSES),
        id2label=dict(enumerate(CLASSES)),
        label2id={name: i for i, name in enumerate(CLASSES)},
    )
    settings.update(overrides)
    return ViTConfig(**settings)


def build_model(script_args: ScriptArguments):
    if script_args.model_name_or_path:
        return AutoModelForImageClassification.from_pretrained(
            script_args.model_name_or_path,
            num_labels=len(CLASSES),
            id2label=dict(enumerate(CLASSES)),
            label2id={name: i for i, name in enumerate(CLASSES)},
            ignore_mismatched_sizes=True,  # a checkpoint's own classifier (e.g. 1,000 ImageNet classes) is replaced
        )
    return ViTForImageClassification(tiny_config())


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


# The tiny model is trained from scratch: it needs larger steps and more epochs than fine-tuning's defaults.
SCRATCH_DEFAULTS = {"learning_rate": 2e-3, "num_train_epochs": 12, "warmup_steps": 10}


def flag_given(name: str) -> bool:
    return any(arg == f"--{name}" or arg.startswith(f"--{name}=") for arg in sys.argv[1:])


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    parser.set_defaults(
        output_dir="outputs/image_classification",
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=10,
        report_to="none",
    )
    script_args, training_args = parser.parse_args_into_dataclasses()
    if script_args.model_name_or_path is None:
        for name, value in SCRATCH_DEFAULTS.items():  # flags given on the command line win
            if not flag_given(name):
                setattr(training_args, name, value)

    set_seed(training_args.seed)  # the model's initial weights too (the Trainer seeds only after it is built)
    model = build_model(script_args)
    image_size = model.config.image_size
    seed = training_args.seed
    train_rows = synthetic_squares(script_args.num_train_images, image_size, script_args.noise, seed)
    eval_rows = synthetic_squares(script_args.num_eval_images, image_size, script_args.noise, seed + 1)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        compute_metrics=accuracy,
    )
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.wait_for_everyone()

    if trainer.is_world_process_zero():
        max_diff = check_reload(trainer, training_args.output_dir, AutoModelForImageClassification)
        print(f"Saved the model to {training_args.output_dir}")
        print(f"Reload check: from_pretrained gives the same logits (max |diff| = {max_diff:.2e}).")
    if torch.distributed.is_initialized():
        # Part together: release the DDP wrapper, then destroy the process group (hf_parallel would do it at exit).
        trainer.accelerator.wait_for_everyone()
        release_distributed()


if __name__ == "__main__":
    main()
