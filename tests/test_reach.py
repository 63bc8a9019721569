"""
Where users train beyond a plain transformers model: PEFT adapters, Trainer subclasses (transformers'
Seq2SeqTrainer, TRL's SFTTrainer through `TrainerMixin`), torch.compile with evaluate() before train() under DDP.
Each next to a stock control that shows the stock error. LoRA also has rows in the exact-loss matrix
(tests/heads.py: `lora_bert_single_label`, `lora_llama_causal_lm`).
"""

from __future__ import annotations

import json
import os

import datasets
import peft
import pytest
import torch
import torch.distributed as dist
import transformers
from trl import SFTConfig, SFTTrainer

import hf_parallel
from hf_parallel import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerMixin, TrainingArguments
from hf_parallel.testing import spawn_cpu_ranks
from tests.harness import SGD_STEP, TRAIN_ROWS, Topology, run_case, training_args
from tests.heads import CASES, lm_rows, seq2seq_rows
from tests.tiny import ListDataset, classification_rows, tiny_bert_classifier

GA2 = Topology("grad-accum 2", per_device=TRAIN_ROWS // 2, accumulation=2)

# ---- PEFT -----------------------------------------------------------------------------------------------------------


def test_lora_stock_control_is_off_where_hf_parallel_is_exact():
    """The matrix checks LoRA under GA, DataParallel and DDP; here the stock error it fixes: x2 under GA 2."""
    reference = run_case("lora_bert_single_label", Topology("single 2B", per_device=TRAIN_ROWS))
    stock = run_case("lora_bert_single_label", GA2, stock=True)
    ours = run_case("lora_bert_single_label", GA2)
    assert stock["loss"] / reference["loss"] == pytest.approx(2.0, rel=1e-3)
    assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)


def _prompt_tuned_llama(seed: int):
    model = CASES["llama_causal_lm"].build(seed)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    return peft.get_peft_model(model, config)


def test_virtual_tokens_on_a_decoder_fall_back_with_one_warning(hf_parallel_log):
    # Prompt tuning prepends virtual tokens: the logits have more positions than the labels, so no exact loss.
    case = CASES["llama_causal_lm"]
    prompt_case = type(case)("prompt_tuned_llama", _prompt_tuned_llama, lm_rows)
    ours = run_case(prompt_case, GA2, eval_rows=0)
    stock = run_case(prompt_case, GA2, stock=True, eval_rows=0)
    assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-6)
    fallbacks = [m for m in hf_parallel_log.messages if m.startswith("exact_loss:")]
    assert len(fallbacks) == 1, fallbacks
    assert "PROMPT_TUNING adapter on LlamaForCausalLM prepends virtual tokens" in fallbacks[0]


# ---- Seq2SeqTrainer -------------------------------------------------------------------------------------------------


def _seq2seq_trainer(trainer_cls, args_cls, output_dir, eval_rows: int = 7):
    case = CASES["bart_seq2seq"]
    args = training_args(
        output_dir,
        args_cls=args_cls,
        predict_with_generate=True,
        generation_max_length=6,
        per_device_eval_batch_size=2,
    )
    return trainer_cls(model=case.build(0), args=args, eval_dataset=case.dataset(eval_rows, seed=2))


def test_seq2seq_arguments_keep_their_generation_fields(tmp_path):
    stock_args = training_args(tmp_path, args_cls=transformers.Seq2SeqTrainingArguments, predict_with_generate=True)
    trainer = Seq2SeqTrainer(model=CASES["bart_seq2seq"].build(0), args=stock_args)
    assert isinstance(trainer.args, Seq2SeqTrainingArguments)
    saved = trainer.args.to_dict()
    assert saved["predict_with_generate"] is True and saved["exact_loss"] is True
    assert "generation_max_length" in saved and "generation_num_beams" in saved
    assert isinstance(hf_parallel.Seq2SeqTrainingArguments(output_dir=str(tmp_path)), transformers.TrainingArguments)


def test_seq2seq_eval_loss_with_generation_is_exact(tmp_path):
    ours = _seq2seq_trainer(Seq2SeqTrainer, Seq2SeqTrainingArguments, tmp_path / "ours")
    stock = _seq2seq_trainer(transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments, tmp_path / "stock")
    # The definition: the model's mean loss over every label token of the whole evaluation set, in one batch.
    rows = seq2seq_rows(7, 2)
    whole = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    with torch.no_grad():
        expected = CASES["bart_seq2seq"].build(0).eval()(**whole).loss.item()
    ours_loss, stock_loss = ours.evaluate()["eval_loss"], stock.evaluate()["eval_loss"]
    assert ours_loss == pytest.approx(expected, rel=1e-5)
    assert abs(stock_loss - expected) > 1e-4  # stock: the mean of per-batch means
    # Generation is the stock one.
    eval_set = CASES["bart_seq2seq"].dataset(7, seed=2)
    assert (ours.predict(eval_set).predictions == stock.predict(eval_set).predictions).all()


# ---- TRL, through TrainerMixin --------------------------------------------------------------------------------------


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


# ---- torch.compile, evaluate() before train(), DDP ------------------------------------------------------------------


def _compiled_after_evaluate(output_dir: str) -> None:
    report = {}
    for name, trainer_cls, args_cls in (
        ("ours", Trainer, TrainingArguments),
        ("stock", transformers.Trainer, transformers.TrainingArguments),
    ):
        args = training_args(
            os.path.join(output_dir, name), args_cls=args_cls,
            # Each rank its own data order: without DDP the copies drift apart.
            **{**SGD_STEP, "max_steps": 2, "data_seed": dist.get_rank()},
            per_device_train_batch_size=2, torch_compile=True, torch_compile_backend="eager",
        )  # fmt: skip
        trainer = trainer_cls(
            model=tiny_bert_classifier(), args=args, train_dataset=classification_rows(16),
            eval_dataset=classification_rows(4),
        )  # fmt: skip
        assert args.world_size == 2
        trainer.evaluate()
        trainer.train()
        flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(gathered, flat)
        report[name] = (gathered[0] - gathered[1]).abs().max().item()
    if dist.get_rank() == 0:
        with open(os.path.join(output_dir, "report.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_model_evaluated_first_still_trains_in_sync(tmp_path):
    spawn_cpu_ranks(_compiled_after_evaluate, (str(tmp_path),), num_processes=2)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ours"] == 0.0  # trained in DDP: the ranks stay equal
    assert report["stock"] > 1e-3  # stock never wraps it: the ranks drift apart


# ---- average_tokens_across_devices ----------------------------------------------------------------------------------


def test_average_tokens_off_is_said_to_have_no_effect(tmp_path, hf_parallel_log):
    args = training_args(tmp_path, average_tokens_across_devices=False)
    Trainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_rows(4))
    assert any("average_tokens_across_devices=False has no effect" in m for m in hf_parallel_log.messages)


# ---- Evaluation of packed batches under DDP: every sample counted once ----------------------------------------------

PACKED_EVAL_SIZES = (1, 3, 5, 7)


def _packed_rows(n: int) -> list[dict]:
    """Causal LM sequences without padding, for `DataCollatorWithFlattening` (one row per batch, all sequences)."""
    # Row 0 of lm_rows is a single token (nothing to predict): skipped, so that every set has items.
    sequences = [r["input_ids"][r["attention_mask"].bool()].tolist() for r in lm_rows(n + 1, 3)[1:]]
    return [{"input_ids": ids, "labels": ids} for ids in sequences]


def _packed_eval_losses(trainer_cls, args_cls, output_dir: str) -> dict[int, float]:
    losses = {}
    for n in PACKED_EVAL_SIZES:
        args = training_args(
            os.path.join(output_dir, str(n)), args_cls=args_cls, per_device_eval_batch_size=2,
            remove_unused_columns=False,
        )  # fmt: skip
        trainer = trainer_cls(
            model=CASES["llama_causal_lm"].build(0), args=args, eval_dataset=ListDataset(_packed_rows(n)),
            data_collator=transformers.DataCollatorWithFlattening(),
        )  # fmt: skip
        losses[n] = trainer.evaluate()["eval_loss"]
    return losses


def _packed_eval_ranks(output_dir: str) -> None:
    assert dist.get_world_size() == 2
    report = {
        "ours": _packed_eval_losses(Trainer, TrainingArguments, output_dir),
        "stock": _packed_eval_losses(transformers.Trainer, transformers.TrainingArguments, output_dir),
    }
    if dist.get_rank() == 0:
        with open(os.path.join(output_dir, "report.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def _packed_definition(n: int) -> float:
    """Sum of the token losses over count of predicted tokens, sequence by sequence, each counted once."""
    model = CASES["llama_causal_lm"].build(0).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in _packed_rows(n):
            ids = torch.tensor([row["input_ids"]])
            if ids.shape[1] > 1:
                logits = model(input_ids=ids).logits[0, :-1]
                total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
                count += ids.shape[1] - 1
    return total / count


@pytest.mark.slow
def test_packed_evaluation_counts_each_sample_once_under_ddp(tmp_path):
    spawn_cpu_ranks(_packed_eval_ranks, (str(tmp_path),), num_processes=2)
    report = json.loads((tmp_path / "report.json").read_text())
    for n in PACKED_EVAL_SIZES:
        expected = _packed_definition(n)
        assert report["ours"][str(n)] == pytest.approx(expected, rel=1e-5), n
    # Stock counts the duplicate accelerate pads in (and averages per-batch means): off where the set is uneven.
    assert abs(report["stock"]["7"] - _packed_definition(7)) > 1e-4
