"""
CleanCheckpointCallback: the stock `transformers.Trainer` given a wrapped model writes clean checkpoints and resumes
from them. The memory and gpu0_bsz advisor callbacks are tested with BalancedDataParallel, in
test_balanced_trainer.py.
"""

import json
import os

import pytest
import safetensors.torch
import transformers
from torch import nn
from transformers import TrainerControl, TrainerState

from hf_parallel import CleanCheckpointCallback
from hf_parallel.checkpoints import checkpoint_weight_files, stored_keys
from tests.test_saving import assert_clean_checkpoint, assert_same_weights, setup_case, weights_of
from tests.tiny import tiny_bert_classifier


@pytest.mark.parametrize("case", ["user_dp", "user_compiled"])
def test_callback_cleans_stock_checkpoints(case, tmp_path, caplog):
    kw = dict(trainer_cls=transformers.Trainer, args_cls=transformers.TrainingArguments, remove_unused_columns=False)
    callback = CleanCheckpointCallback()
    with setup_case(case, tmp_path / "run", callbacks=[callback], **kw) as (stock, model):
        stock.train()
        final = weights_of(model)
    assert callback.rewritten == [str(tmp_path / "run" / f"checkpoint-{s}") for s in (2, 4)]
    assert_clean_checkpoint(tmp_path / "run" / "checkpoint-2", model, same_step=False)
    assert_clean_checkpoint(tmp_path / "run" / "checkpoint-4", model)

    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    if case == "user_dp":
        assert "cannot resume from them into the wrapper" in caplog.text
        # The documented way: stock gets the bare model (and wraps it itself on several GPUs).
        with setup_case("dp", tmp_path / "bare", seed=1, callbacks=[CleanCheckpointCallback()], **kw) as (resumed, _):
            resumed.train(resume_from_checkpoint=checkpoint)
            assert_same_weights(weights_of(resumed.model), final)
        return
    # Stock resumes the compiled wrapper non-strictly, matching no clean key; the callback loads the checkpoint.
    with setup_case(case, tmp_path / "run", seed=1, callbacks=[CleanCheckpointCallback()], **kw) as (resumed, _):
        resumed.train(resume_from_checkpoint=checkpoint)
        assert_same_weights(weights_of(resumed.model), final)
    with setup_case(case, tmp_path / "run", seed=1, **kw) as (control, _):  # without the callback
        control.train(resume_from_checkpoint=checkpoint)
        control_final = weights_of(control.model)
    assert (control_final["classifier.weight"] - final["classifier.weight"]).abs().max() > 1e-3


def test_callback_leaves_clean_checkpoints_alone(tmp_path):
    callback = CleanCheckpointCallback()
    kw = dict(trainer_cls=transformers.Trainer, args_cls=transformers.TrainingArguments)
    with setup_case("plain", tmp_path, callbacks=[callback], **kw) as (stock, _):
        stock.train()
    assert callback.rewritten == []


def test_callback_replaces_every_file_of_a_sharded_prefixed_checkpoint(tmp_path):
    model = tiny_bert_classifier()
    checkpoint = tmp_path / "checkpoint-3"
    model.save_pretrained(checkpoint, max_shard_size="4KB")
    # The checkpoint a stock Trainer holding nn.DataParallel(model) would write: every key under `module.`.
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = safetensors.torch.load_file(checkpoint / shard)
        safetensors.torch.save_file({"module." + k: v for k, v in tensors.items()}, checkpoint / shard)
    index["weight_map"] = {"module." + k: v for k, v in index["weight_map"].items()}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    shards = [p for p in checkpoint_weight_files(checkpoint, shards=True) if not p.endswith(".json")]
    assert len(shards) > 1

    callback = CleanCheckpointCallback()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    callback.on_save(args, TrainerState(global_step=3), TrainerControl(), model=nn.DataParallel(model))
    assert callback.rewritten == [str(checkpoint)]
    assert checkpoint_weight_files(checkpoint, shards=True) == [str(checkpoint / "model.safetensors")]
    assert not any(os.path.exists(p) for p in shards)  # no stale shard of the prefixed weights is left behind
    assert sorted(stored_keys(checkpoint / "model.safetensors")) == sorted(model.state_dict())
    assert_clean_checkpoint(checkpoint, model)
