"""Train a CTC speech recogniser (Wav2Vec2) with `hf_parallel.Trainer`, decode, save, reload, and check the reload.

With no arguments it trains a tiny Wav2Vec2ForCTC built from a config on synthetic "speech" made in code: each
character is a tone of its own frequency, separated by short silences, in utterances of 2 to 7 characters (so of
uneven lengths, padded in each batch with an attention mask; the labels are padded with -100). On CPU it takes
seconds; it prints the eval loss before and after training, the first and last logged training losses, and a greedy
CTC decode of a few eval utterances next to the truth. Every `TrainingArguments` flag works
(`--per_device_train_batch_size`, `--num_train_epochs`, `--output_dir`, `--gpu0_bsz`, `--exact_loss`, ...), plus
the flags below (`--help` lists all).

One process (CPU, or one GPU; several GPUs without a launcher use DataParallel):

    python examples/speech_recognition.py
    python examples/speech_recognition.py --model_name_or_path facebook/wav2vec2-base \\
        --learning_rate 1e-4 --num_train_epochs 20

DDP over the GPUs of one machine (one process per GPU), or over 2 CPU processes on a machine without GPUs (the
processes need `--use_cpu`: accelerate does not pass the config's `use_cpu` on, and without it the Trainer stops):

    accelerate launch --config_file hf_parallel/configs/multi_gpu.yaml --num_processes 4 \\
        examples/speech_recognition.py
    accelerate launch --config_file hf_parallel/configs/cpu_ddp.yaml examples/speech_recognition.py --use_cpu

With `--model_name_or_path`, the encoder is the checkpoint's and the CTC head is new (sized to this vocabulary); each
character lasts `--frames_per_character` frames of that model (its convolutions' total stride), at 16 kHz.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCTC,
    HfArgumentParser,
    Wav2Vec2Config,
    Wav2Vec2CTCTokenizer,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2ForCTC,
    Wav2Vec2Processor,
    set_seed,
)

from hf_parallel import Trainer, TrainingArguments, check_reload, release_distributed

SAMPLING_RATE = 16_000
# Each character is a tone of its own frequency (Hz); "[PAD]" is the CTC blank.
TONES = {"a": 700.0, "b": 1100.0, "c": 1700.0, "d": 2500.0, "e": 3500.0, "f": 5000.0}


@dataclass
class ScriptArguments:
    # Parameters that control the model
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A hub model id or a local folder. Default: a tiny Wav2Vec2 built from a config."},
    )
    # Parameters that control the data
    num_train_utterances: int = field(default=400, metadata={"help": "Synthetic training utterances."})
    num_eval_utterances: int = field(default=64, metadata={"help": "Synthetic evaluation utterances."})
    # 2: with 6-10 frames a character, the tiny model stays on CTC's all-blank plateau for hundreds of steps.
    frames_per_character: int = field(default=2, metadata={"help": "How many model frames a character lasts."})
    noise: float = field(default=0.1, metadata={"help": "Standard deviation of the noise (tones have amplitude ~1)."})
    num_decoded: int = field(default=3, metadata={"help": "Eval utterances whose greedy decode is printed."})


def build_processor(folder: Path) -> Wav2Vec2Processor:
    """A character tokenizer over the tones (blank = "[PAD]") and a 16 kHz feature extractor, built locally."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "|": 2, **{char: i + 3 for i, char in enumerate(TONES)}}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = Wav2Vec2CTCTokenizer(
        str(folder / "vocab.json"),
        unk_token="[UNK]",
        pad_token="[PAD]",
        word_delimiter_token="|",
        bos_token=None,  # CTC needs none; by default the tokenizer would add "<s>" and "</s>" to the vocabulary
        eos_token=None,
    )
    feature_extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=SAMPLING_RATE, padding_value=0.0, do_normalize=True, return_attention_mask=True
    )
    return Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)


def synthetic_speech(
    num_utterances: int, processor: Wav2Vec2Processor, samples_per_frame: int, script_args: ScriptArguments, seed: int
) -> list[dict]:
    """
    Utterances of 2-7 random characters: each a tone of its frequency lasting about `frames_per_character` frames
    (give or take 20%), with a random amplitude and phase, then a silence of a third of that; plus noise.
    """
    rng = np.random.default_rng(seed)
    chars = list(TONES)
    char_samples = script_args.frames_per_character * samples_per_frame
    rows = []
    for _ in range(num_utterances):
        text = "".join(rng.choice(chars, size=int(rng.integers(2, 8))))
        pieces = []
        for char in text:
            n = int(char_samples * rng.uniform(0.8, 1.2))
            t = np.arange(n) / SAMPLING_RATE
            phase = rng.uniform(0, 2 * math.pi)
            pieces.append(rng.uniform(0.5, 1.0) * np.sin(2 * math.pi * TONES[char] * t + phase))
            pieces.append(np.zeros(char_samples // 3))
        wave = np.concatenate(pieces) + rng.normal(0.0, script_args.noise, size=sum(len(p) for p in pieces))
        features = processor.feature_extractor(wave.astype(np.float32), sampling_rate=SAMPLING_RATE)
        rows.append({"input_values": features["input_values"][0], "labels": processor.tokenizer(text).input_ids})
    return rows


@dataclass
class DataCollatorCTCWithPadding:
    """Pads `input_values` (with an `attention_mask`) and `labels` (with -100, which the CTC loss ignores)."""

    processor: Wav2Vec2Processor

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.processor.feature_extractor.pad(
            [{"input_values": f["input_values"]} for f in features],
            padding=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        labels = self.processor.tokenizer.pad(
            [{"input_ids": f["labels"]} for f in features], padding=True, return_tensors="pt"
        )
        batch["labels"] = labels["input_ids"].masked_fill(labels["attention_mask"].ne(1), -100)
        return batch


def tiny_config(processor: Wav2Vec2Processor, **overrides) -> Wav2Vec2Config:
    """The default model: two strided convolutions (10 samples a frame) and a 2-layer encoder of width 32."""
    settings = dict(
        vocab_size=len(processor.tokenizer),
        pad_token_id=processor.tokenizer.pad_token_id,
        conv_dim=(32, 32),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        feat_extract_norm="layer",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,  # no SpecAugment: the utterances are only a few dozen frames long
        layerdrop=0.0,
        hidden_dropout=0.0,  # no dropout: a model this small does not overfit these utterances, and learns faster
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
    )
    settings.update(overrides)
    return Wav2Vec2Config(**settings)


def build_model(script_args: ScriptArguments, processor: Wav2Vec2Processor):
    if script_args.model_name_or_path is None:
        return Wav2Vec2ForCTC(tiny_config(processor))
    model = AutoModelForCTC.from_pretrained(
        script_args.model_name_or_path,
        vocab_size=len(processor.tokenizer),
        pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
        ignore_mismatched_sizes=True,  # a checkpoint's own CTC head (another vocabulary) is replaced
    )
    model.freeze_feature_encoder()  # the usual fine-tuning recipe: the convolutions keep their pretrained weights
    return model


# The tiny model is trained from scratch: it needs larger steps and more epochs than fine-tuning's defaults.
SCRATCH_DEFAULTS = {"learning_rate": 3e-3, "num_train_epochs": 10, "warmup_steps": 20}


def flag_given(name: str) -> bool:
    return any(arg == f"--{name}" or arg.startswith(f"--{name}=") for arg in sys.argv[1:])


def parse_args() -> tuple[ScriptArguments, TrainingArguments]:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    parser.set_defaults(
        output_dir="outputs/speech_recognition",
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
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
    return script_args, training_args


def main() -> None:
    script_args, training_args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        processor = build_processor(Path(folder))
    set_seed(training_args.seed)  # the model's initial weights too (the Trainer seeds only after it is built)
    model = build_model(script_args, processor)
    samples_per_frame = math.prod(model.config.conv_stride)
    seed = training_args.seed
    train_rows = synthetic_speech(script_args.num_train_utterances, processor, samples_per_frame, script_args, seed)
    eval_rows = synthetic_speech(script_args.num_eval_utterances, processor, samples_per_frame, script_args, seed + 1)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        processing_class=processor,
        data_collator=DataCollatorCTCWithPadding(processor),
    )
    loss_before = trainer.evaluate()["eval_loss"]
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.wait_for_everyone()

    if trainer.is_world_process_zero():
        train_losses = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
        if train_losses:
            (first_step, first), (last_step, last) = train_losses[0], train_losses[-1]
            print(f"Train loss: {first:.4f} first logged (step {first_step}), ", end="")
            print(f"{last:.4f} last logged (step {last_step})")
        print(f"Eval loss: {loss_before:.4f} before training, {metrics['eval_loss']:.4f} after")
        print_decodes(trainer, processor, eval_rows[: script_args.num_decoded])
        max_diff = check_reload(trainer, training_args.output_dir, AutoModelForCTC)
        Wav2Vec2Processor.from_pretrained(training_args.output_dir)  # the processor was saved too, and loads
        print(f"Saved the model and processor to {training_args.output_dir}")
        print(f"Reload check: from_pretrained gives the same logits (max |diff| = {max_diff:.2e}).")
    if torch.distributed.is_initialized():
        # Part together: release the DDP wrapper, then destroy the process group (hf_parallel would do it at exit).
        trainer.accelerator.wait_for_everyone()
        release_distributed()


def print_decodes(trainer: Trainer, processor: Wav2Vec2Processor, rows: list[dict]) -> None:
    """Greedy CTC decoding (the best token of each frame; repeats merged, blanks dropped), one utterance at a time."""
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    device = next(model.parameters()).device
    for row in rows:
        values = torch.as_tensor(row["input_values"], device=device)[None]
        with torch.no_grad():
            predicted_ids = model(input_values=values).logits.argmax(-1)[0]
        truth = processor.tokenizer.decode(row["labels"], group_tokens=False)
        print(f"  truth: {truth:<8} decoded: {processor.tokenizer.decode(predicted_ids)}")


if __name__ == "__main__":
    main()
