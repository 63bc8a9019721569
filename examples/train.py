"""Fine-tune a text classifier with `hf_parallel.Trainer`, evaluate, save, reload, and check the reload.

With no arguments it trains a tiny BERT built from a config on a small sentiment set made in code, on CPU in
seconds. Every `TrainingArguments` flag works (`--per_device_train_batch_size`, `--num_train_epochs`,
`--output_dir`, `--gpu0_bsz`, `--exact_loss`, ...), plus the data and model flags below (`--help` lists all).

One process (CPU, or one GPU; several GPUs without a launcher use DataParallel):

    python examples/train.py
    python examples/train.py --model_name_or_path bert-base-uncased --train_file data.csv --text_column text

DDP over the GPUs of one machine (one process per GPU), or over 2 CPU processes on a machine without GPUs (the
processes need `--use_cpu`: accelerate does not pass the config's `use_cpu` on, and without it the Trainer stops):

    accelerate launch --config_file hf_parallel/configs/multi_gpu.yaml --num_processes 4 examples/train.py
    accelerate launch --config_file hf_parallel/configs/cpu_ddp.yaml examples/train.py --use_cpu
    hf-parallel config -o ddp.yaml   # a config for this machine (or several: see the README); prints the command
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    PreTrainedTokenizerFast,
)

from hf_parallel import Trainer, TrainingArguments, check_reload, release_distributed


@dataclass
class ScriptArguments:
    # Parameters that control the model
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A hub model id or a local folder. Default: a tiny BERT built from a config (no download)."},
    )
    # Parameters that control the data
    dataset_name: str | None = field(default=None, metadata={"help": "A hub dataset name (e.g. imdb)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The hub dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "A local .csv, .json or .jsonl training file."})
    validation_file: str | None = field(default=None, metadata={"help": "A local .csv, .json or .jsonl eval file."})
    text_column: str = field(default="text", metadata={"help": "The column holding the text."})
    label_column: str = field(default="label", metadata={"help": "The column holding the class label."})
    max_length: int = field(default=128, metadata={"help": "Truncate texts to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training rows."})


# The default task: a sentence is positive when it has more positive than negative words.
POSITIVE = ["good", "great", "fine", "happy", "love", "nice", "superb", "bright", "calm", "fun"]
NEGATIVE = ["bad", "awful", "poor", "sad", "hate", "nasty", "dull", "dark", "angry", "boring"]
NEUTRAL = ["the", "a", "movie", "day", "food", "was", "and", "very", "it", "this", "really", "so", "place"]


def synthetic_sentiment(num_rows: int, seed: int) -> datasets.Dataset:
    """Sentences of 4-12 words; label 1 when positive words outnumber negative ones (ties are dropped)."""
    rng = random.Random(seed)
    texts, labels = [], []
    while len(texts) < num_rows:
        n_pos, n_neg = rng.randint(0, 3), rng.randint(0, 3)
        if n_pos == n_neg:
            continue
        words = rng.choices(POSITIVE, k=n_pos) + rng.choices(NEGATIVE, k=n_neg)
        words += rng.choices(NEUTRAL, k=rng.randint(4, 12) - len(words)) if len(words) < 4 else []
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(int(n_pos > n_neg))
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the synthetic vocabulary, built locally (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {tok: i for i, tok in enumerate(specials + POSITIVE + NEGATIVE + NEUTRAL)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def load_data(script_args: ScriptArguments, seed: int) -> datasets.DatasetDict:
    if script_args.dataset_name:
        raw = datasets.load_dataset(script_args.dataset_name, script_args.dataset_config_name)
    elif script_args.train_file:
        files = {"train": script_args.train_file}
        if script_args.validation_file:
            files["validation"] = script_args.validation_file
        extension = script_args.train_file.rsplit(".", 1)[-1]
        if extension not in ("csv", "json", "jsonl"):
            raise ValueError(f"--train_file must end in .csv, .json or .jsonl, got {script_args.train_file!r}.")
        raw = datasets.load_dataset("json" if extension == "jsonl" else extension, data_files=files)
    else:
        return datasets.DatasetDict(
            {"train": synthetic_sentiment(320, seed), "validation": synthetic_sentiment(64, seed + 1)}
        )
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=0.1, seed=seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    for column in (script_args.text_column, script_args.label_column):
        if column not in raw["train"].column_names:
            raise ValueError(
                f"The training data has no column {column!r} (it has {raw['train'].column_names}); "
                "name the right ones with --text_column and --label_column."
            )
    if raw["train"].features[script_args.label_column].dtype == "string":
        raw = raw.class_encode_column(script_args.label_column)
    return raw


def build_model_and_tokenizer(script_args: ScriptArguments, num_labels: int):
    if script_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(
            script_args.model_name_or_path, num_labels=num_labels
        )
        return model, tokenizer
    tokenizer = word_tokenizer()
    return BertForSequenceClassification(tiny_config(tokenizer, num_labels)), tokenizer


def tiny_config(tokenizer: PreTrainedTokenizerFast, num_labels: int, **overrides) -> BertConfig:
    """The default model: a 2-layer BERT classifier small enough to train on 2 CPU cores in seconds."""
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(overrides)
    return BertConfig(**settings)


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


SCRATCH_DEFAULTS = {"learning_rate": 1e-3, "num_train_epochs": 10}


def flag_given(name: str) -> bool:
    return any(arg == f"--{name}" or arg.startswith(f"--{name}=") for arg in sys.argv[1:])


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    parser.set_defaults(
        output_dir="outputs/train",
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=10,
        report_to="none",
    )
    script_args, training_args = parser.parse_args_into_dataclasses()
    if script_args.model_name_or_path is None:
        # The tiny model is trained from scratch: it needs larger steps and more epochs than fine-tuning's
        # defaults (5e-5, 3 epochs). Flags given on the command line win.
        for name, value in SCRATCH_DEFAULTS.items():
            if not flag_given(name):
                setattr(training_args, name, value)

    raw = load_data(script_args, training_args.seed)
    if script_args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(script_args.max_train_samples, len(raw["train"]))))
    num_labels = len(set(raw["train"][script_args.label_column]))
    model, tokenizer = build_model_and_tokenizer(script_args, num_labels)

    def tokenize(batch):
        return tokenizer(batch[script_args.text_column], truncation=True, max_length=script_args.max_length)

    with training_args.main_process_first(desc="tokenize"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=[script_args.text_column])
    if script_args.label_column != "labels":
        tokenized = tokenized.rename_column(script_args.label_column, "labels")

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.wait_for_everyone()

    # On every process: under DeepSpeed ZeRO-3 each holds a slice of every parameter, and the forward needs them all.
    max_diff = check_reload(trainer, training_args.output_dir, AutoModelForSequenceClassification)
    if trainer.is_world_process_zero():
        print(f"Saved the model and tokenizer to {training_args.output_dir}")
        print(f"Reload check: from_pretrained gives the same logits (max |diff| = {max_diff:.2e}).")
    if torch.distributed.is_initialized():
        # Part together: release the DDP wrapper, then destroy the process group (hf_parallel would do it at exit).
        trainer.accelerator.wait_for_everyone()
        release_distributed()


if __name__ == "__main__":
    main()
