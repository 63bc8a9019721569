"""
A training that test_saving.py kills with SIGKILL mid-epoch, then resumes from its last checkpoint.

    PYTHONPATH=. python tests/distributed/save_train_worker.py OUTPUT_DIR STOP_AT_STEP

Trains `hf_parallel.Trainer` with `save_steps` and, once the optimizer step STOP_AT_STEP is done (a checkpoint exists
by then), writes OUTPUT_DIR/ready and waits to be killed, as a job killed by a scheduler or the OOM killer would
be. `make_trainer` is shared with the test so that both runs are configured the same.
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import BertForSequenceClassification  # noqa: E402

from hf_parallel import Trainer  # noqa: E402
from tests.helpers.harness import training_args  # noqa: E402
from tests.helpers.tiny import classification_rows, tiny_bert_config  # noqa: E402

MAX_STEPS = 8
SAVE_STEPS = 3
ROWS = 24  # 12 steps an epoch at batch 2: every step of the run is mid-epoch


def make_trainer(output_dir: str, seed: int = 0, callbacks=None) -> Trainer:
    torch.manual_seed(seed)
    # Dropout makes the result depend on the RNG state the resumed run restores.
    model = BertForSequenceClassification(tiny_bert_config(num_labels=2, hidden_dropout_prob=0.1))
    args = training_args(
        output_dir,
        per_device_train_batch_size=2,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        save_strategy="steps",
        learning_rate=1e-2,
        logging_steps=100,
    )
    return Trainer(model=model, args=args, train_dataset=classification_rows(ROWS, seed=1), callbacks=callbacks)


class _StopHere(transformers.TrainerCallback):
    def __init__(self, output_dir: str, stop_at: int):
        self.output_dir, self.stop_at = output_dir, stop_at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            Path(self.output_dir, "ready").write_text(str(state.global_step))
            time.sleep(600)  # killed here; never returns in the test


if __name__ == "__main__":
    output_dir, stop_at = sys.argv[1], int(sys.argv[2])
    make_trainer(output_dir, callbacks=[_StopHere(output_dir, stop_at)]).train()
    sys.exit(f"the run was not killed at step {stop_at}")
