"""The package is a drop-in: same results as stock transformers, and the example runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

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
