"""
TRL's SFTTrainer through `TrainerMixin` (first in the bases) and through `hf_parallel.Trainer` (combined): its
config class, its own loss and its own logs stay, next to the stock SFTTrainer's run.
"""

from __future__ import annotations

import pytest
import transformers

import hf_parallel
from hf_parallel import TrainerMixin
from tests.helpers.heads import CASES, lm_rows

# TRL (a test extra) and datasets are absent from some GPU images, where `benchmarks.gpu_check` collects every test
# module: without them this module skips instead of failing the whole collection (pytest's exit 2).
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
SFTConfig, SFTTrainer = trl.SFTConfig, trl.SFTTrainer


class ParallelSFTTrainer(TrainerMixin, SFTTrainer):
    pass


class CombinedSFTTrainer(hf_parallel.Trainer, SFTTrainer):
    pass


def _sft_run(trainer_cls, output_dir) -> transformers.Trainer:
    from examples.train import word_tokenizer

    rows = lm_rows(8, 1)
    texts = datasets.Dataset.from_list(
        [{"input_ids": r["input_ids"][r["attention_mask"].bool()].tolist()} for r in rows]
    )
    args = SFTConfig(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
        loss_type="dft", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = trainer_cls(
        model=CASES["llama_causal_lm"].build(0), args=args, train_dataset=texts, processing_class=word_tokenizer()
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("trainer_cls", [ParallelSFTTrainer, CombinedSFTTrainer])
def test_trl_keeps_its_config_and_its_own_loss(trainer_cls, tmp_path, hf_parallel_log):
    stock = _sft_run(SFTTrainer, tmp_path / "stock")
    ours = _sft_run(trainer_cls, tmp_path / "ours")
    # Its config class stays (TRL rebuilds it from to_dict(), which must not carry our fields), with our settings.
    assert type(ours.args) is SFTConfig and "exact_loss" not in ours.args.to_dict()
    assert ours.args.exact_loss is True
    # TRL's own loss (loss_type="dft") and its own logs, untouched.
    assert [log.get("loss") for log in ours.state.log_history] == [log.get("loss") for log in stock.state.log_history]
    assert "entropy" in ours.state.log_history[0]
    assert any("SFTTrainer overrides compute_loss" in m for m in hf_parallel_log.messages), hf_parallel_log.messages
