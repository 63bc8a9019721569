"""The package is a drop-in: same results as stock transformers, new fields parse and validate, the example runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import HfArgumentParser

import hf_parallel
from hf_parallel import Trainer, TrainingArguments
from tests.tiny import classification_rows, tiny_bert_classifier

ROOT = Path(__file__).resolve().parents[1]


def _args(cls, tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return cls(**base)


class LossLog(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _train(trainer_cls, args_cls, tmp_path, **kw):
    log = LossLog()
    trainer = trainer_cls(
        model=tiny_bert_classifier(seed=0),
        args=_args(args_cls, tmp_path, **kw),
        train_dataset=classification_rows(12),
        callbacks=[log],
    )
    trainer.train()
    return log.losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_public_names():
    assert set(hf_parallel.__all__) >= {"Trainer", "TrainingArguments"}
    # Every public name resolves through the lazy loader, and the loader knows no name that is not public.
    assert set(hf_parallel._EXPORTS) == set(hf_parallel.__all__) - {"__version__"}
    for name in hf_parallel.__all__:
        assert getattr(hf_parallel, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        hf_parallel.Trainr  # noqa: B018
    assert issubclass(Trainer, transformers.Trainer)
    assert issubclass(TrainingArguments, transformers.TrainingArguments)


def test_drop_in_single_process_matches_stock(tmp_path):
    stock_losses, stock_weights = _train(transformers.Trainer, transformers.TrainingArguments, tmp_path / "a")
    ours_losses, ours_weights = _train(Trainer, TrainingArguments, tmp_path / "b")
    assert len(stock_losses) == 3
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(stock_losses), rtol=1e-6, atol=0)
    assert stock_weights.keys() == ours_weights.keys()
    for name in stock_weights:
        torch.testing.assert_close(ours_weights[name], stock_weights[name], rtol=1e-6, atol=1e-7, msg=name)


def test_stock_arguments_are_upgraded(tmp_path):
    stock = _args(transformers.TrainingArguments, tmp_path, learning_rate=3e-4)
    trainer = Trainer(model=tiny_bert_classifier(), args=stock, train_dataset=classification_rows(4))
    assert isinstance(trainer.args, TrainingArguments)
    assert trainer.args.learning_rate == 3e-4
    assert trainer.args.exact_loss is True
    assert trainer.args.gpu0_bsz is None


def test_new_fields_parse_from_the_command_line(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--gpu0_bsz", "3", "--exact_loss", "False", "--use_cpu", "True"]
    )
    assert args.gpu0_bsz == 3
    assert args.exact_loss is False
    assert args.gpu0_weight is None
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--gpu0_weight", "0.5"])
    assert args.gpu0_weight == 0.5
    assert args.exact_loss is True


def test_help_lists_the_new_fields():
    text = HfArgumentParser(TrainingArguments).format_help()
    for flag in ("--gpu0_bsz", "--gpu0_weight", "--exact_loss"):
        assert flag in text


def test_to_dict_and_json_round_trip(tmp_path):
    args = _args(TrainingArguments, tmp_path, gpu0_bsz=2, exact_loss=False)
    as_dict = json.loads(args.to_json_string())
    assert as_dict["gpu0_bsz"] == 2
    assert as_dict["exact_loss"] is False
    assert as_dict["gpu0_weight"] is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu0_bsz": -1}, "gpu0_bsz must be >= 0"),
        ({"gpu0_bsz": 5}, "gpu0_bsz=5 is above GPU 0's even share"),
        ({"gpu0_bsz": 2.5}, "gpu0_bsz must be a whole number"),
        ({"gpu0_bsz": 1, "gpu0_weight": 0.5}, "Set at most one of gpu0_bsz (1) and gpu0_weight (0.5)"),
        ({"gpu0_weight": float("nan")}, "gpu0_weight must be a finite number in [0, 1]"),
        ({"gpu0_weight": float("inf")}, "got inf"),
        ({"gpu0_weight": -0.1}, "got -0.1"),
        ({"gpu0_weight": 1.5}, "got 1.5"),
        ({"exact_loss": "yes"}, "exact_loss must be True or False"),
    ],
)
def test_bad_values_are_rejected_by_name(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        _args(TrainingArguments, tmp_path, **kwargs)
    assert message in str(excinfo.value)


@pytest.mark.slow
def test_main_example_runs_and_reload_matches(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--output_dir", str(out), "--disable_tqdm", "True"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Saved the model and tokenizer to {out}" in proc.stdout
    assert "Reload check: from_pretrained gives the same logits" in proc.stdout
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    from safetensors.torch import load_file

    keys = load_file(out / "model.safetensors").keys()
    assert not [k for k in keys if k.startswith("module.")]
    # The default run learns the synthetic task: accuracy well above chance.
    accuracy_lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("eval_accuracy")]
    assert accuracy_lines, proc.stdout[-2000:]
    assert float(accuracy_lines[-1].split("=")[1]) >= 0.9
