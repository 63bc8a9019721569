"""
The set-ups the saving tests train in (test_saving.py; test_callbacks.py for CleanCheckpointCallback): the model
handed to the Trainer plain, wrapped by the Trainer, wrapped or compiled by the user, on emulated GPUs; and what a
clean checkpoint of it is.
"""

import contextlib
import os

import torch
from torch import nn
from transformers import BertForSequenceClassification

from hf_parallel import BalancedDataParallel, Trainer, TrainingArguments, unwrap_model
from hf_parallel.saving.checkpoints import stored_keys
from hf_parallel.testing import simulate_data_parallel
from tests.helpers.harness import training_args
from tests.helpers.tiny import classification_rows, tiny_bert_classifier

WRAPPER_PARTS = {"module", "_orig_mod"}

# How each set-up is built: the args, the model handed to the Trainer (a wrapper is built inside the emulation), and
# the emulated GPUs (0: none).
SETUPS = {
    "plain": dict(),
    "dp": dict(n_gpu=2),
    "balanced_dp": dict(n_gpu=3, args=dict(gpu0_bsz=1)),
    "compile": dict(args=dict(torch_compile=True, torch_compile_backend="eager")),
    "user_dp": dict(n_gpu=2, wrap=lambda m: nn.DataParallel(m)),
    "user_balanced_dp": dict(n_gpu=3, wrap=lambda m: BalancedDataParallel(m, gpu0_bsz=1)),
    # A model compiled by the user: stock's column filter sees only `forward(*args, **kwargs)`, so keep every column.
    "user_compiled": dict(wrap=lambda m: torch.compile(m, backend="eager"), args=dict(remove_unused_columns=False)),
}


# 4 steps with a checkpoint every 2: checkpoint-2 to resume from, checkpoint-4 with the final weights.
SAVING = dict(
    per_device_train_batch_size=2,
    max_steps=4,
    save_steps=2,
    save_strategy="steps",
    learning_rate=1e-2,
    logging_steps=100,
)


@contextlib.contextmanager
def setup_case(
    case,
    output_dir,
    seed=0,
    trainer_cls=Trainer,
    args_cls=TrainingArguments,
    callbacks=None,
    eval_dataset=None,
    **extra,
):
    """
    Yield `(trainer, model)` for the set-up `case` (a key of `SETUPS`): `model` is the bare model, handed to the
    Trainer as the set-up says; `extra` are more TrainingArguments.
    """
    spec = SETUPS[case]
    n_gpu = spec.get("n_gpu", 0)
    with simulate_data_parallel(n_gpu) if n_gpu else contextlib.nullcontext():
        args = training_args(
            output_dir, args_cls=args_cls, dp_devices=n_gpu or None, **{**SAVING, **spec.get("args", {}), **extra}
        )
        model = tiny_bert_classifier(seed=seed)
        handed = spec.get("wrap", lambda m: m)(model)
        trainer = trainer_cls(
            model=handed,
            args=args,
            train_dataset=classification_rows(24, seed=1),
            eval_dataset=eval_dataset,
            callbacks=callbacks,
        )
        yield trainer, model


def stored_key_set(checkpoint) -> set[str]:
    """The keys of a checkpoint's model.safetensors."""
    return set(stored_keys(os.path.join(checkpoint, "model.safetensors")))


PROBE = classification_rows(6, seed=7)


def _logits(model):
    batch = {k: torch.stack([r[k] for r in PROBE.rows]) for k in ("input_ids", "attention_mask")}
    model.eval()
    with torch.no_grad():
        return unwrap_model(model)(**batch).logits


def assert_clean_checkpoint(checkpoint, trained, same_step=True):
    """The checkpoint has exactly the model's keys; from_pretrained rebuilds the same predictions (same_step)."""
    inner = unwrap_model(trained)
    keys = stored_key_set(checkpoint)
    assert not any(WRAPPER_PARTS & set(k.split(".")) for k in keys), sorted(keys)[:3]
    assert keys == set(inner.state_dict())
    reloaded, info = BertForSequenceClassification.from_pretrained(checkpoint, output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    if same_step:
        torch.testing.assert_close(_logits(reloaded), _logits(inner), rtol=0, atol=1e-6)
