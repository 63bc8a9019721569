"""
Where users train beyond a plain transformers model: PEFT adapters, transformers' Seq2SeqTrainer (TRL's SFTTrainer
through `TrainerMixin`: tests/test_trl.py), torch.compile with evaluate() before train() under DDP,
packed batches and iterable sets that each rank reads itself (`dispatch_batches=False`) under DDP.
Each next to a stock control that shows the stock error. LoRA also has rows in the exact-loss matrix
(tests/helpers/heads.py: `lora_bert_single_label`, `lora_llama_causal_lm`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader
from transformers.training_args import ParallelMode

import hf_parallel
from hf_parallel import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
from hf_parallel.exact.streams import SampleCounter, count_samples, stream_remainder
from hf_parallel.testing import spawn_cpu_ranks
from hf_parallel.upstream import SHARD_ATTRIBUTES
from tests.helpers.compare import assert_losses_close
from tests.helpers.epochs import EPOCH, ITERABLE, epoch_topology, one_device_epoch, update_error
from tests.helpers.harness import SGD_STEP, TRAIN_ROWS, Topology, record_hf_parallel_log, run_case, training_args
from tests.helpers.heads import CASES, lm_rows, seq2seq_rows
from tests.helpers.tiny import IterableRows, ListDataset, classification_rows, tiny_bert_classifier

GA2 = Topology("grad-accum 2", per_device=TRAIN_ROWS // 2, accumulation=2)

# ---- PEFT -----------------------------------------------------------------------------------------------------------


def test_lora_stock_control_is_off_where_hf_parallel_is_exact():
    """The matrix checks LoRA under GA, DataParallel and DDP; here the stock error it fixes: x2 under GA 2."""
    reference = run_case("lora_bert_single_label", Topology("single 2B", per_device=TRAIN_ROWS))
    stock = run_case("lora_bert_single_label", GA2, stock=True)
    ours = run_case("lora_bert_single_label", GA2)
    assert stock.loss / reference.loss == pytest.approx(2.0, rel=1e-3)
    assert ours.loss == pytest.approx(reference.loss, rel=1e-5)


def _prompt_tuned_llama(seed: int):
    # peft is a test extra, not a requirement: where it is missing (a bare GPU image) this test skips.
    peft = pytest.importorskip("peft")
    model = CASES["llama_causal_lm"].build(seed)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    return peft.get_peft_model(model, config)


def test_virtual_tokens_on_a_decoder_fall_back_with_one_warning(hf_parallel_log):
    # Prompt tuning prepends virtual tokens: the logits have more positions than the labels, so no exact loss.
    case = CASES["llama_causal_lm"]
    prompt_case = type(case)("prompt_tuned_llama", _prompt_tuned_llama, lm_rows)
    ours = run_case(prompt_case, GA2, eval_rows=0)
    stock = run_case(prompt_case, GA2, stock=True, eval_rows=0)
    assert ours.loss == pytest.approx(stock.loss, rel=1e-6)
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
    # predict() generates (evaluate() without compute_metrics asks for the loss only): generation is the stock one,
    # and the loss next to it is exact through Seq2SeqTrainer.prediction_step.
    eval_set = CASES["bart_seq2seq"].dataset(7, seed=2)
    ours_prediction, stock_prediction = ours.predict(eval_set), stock.predict(eval_set)
    assert (ours_prediction.predictions == stock_prediction.predictions).all()
    assert ours_prediction.metrics["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(stock_prediction.metrics["test_loss"] - expected) > 1e-4


# ---- torch.compile, evaluate() before train(), DDP ------------------------------------------------------------------


def _compiled_after_evaluate(output_dir: str) -> dict[str, float]:
    """On each DDP rank: ours and stock, torch.compile'd, evaluate() then train(); how far the ranks' weights are
    apart after."""
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
    return report


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_compiled_model_evaluated_first_still_trains_in_sync(ddp_report):
    report = ddp_report["compiled"]
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


def _packed_eval_report(output_dir: str) -> dict:
    """On each DDP rank: the eval_loss of packed sets of every size, ours and stock."""
    assert dist.get_world_size() == 2
    return {
        "ours": _packed_eval_losses(Trainer, TrainingArguments, os.path.join(output_dir, "ours")),
        "stock": _packed_eval_losses(
            transformers.Trainer, transformers.TrainingArguments, os.path.join(output_dir, "stock")
        ),
    }


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
@pytest.mark.full  # a 2-rank spawn (~7 s): .ci/run runs the full step
def test_packed_evaluation_counts_each_sample_once_under_ddp(ddp_report):
    report = ddp_report["packed"]
    for n in PACKED_EVAL_SIZES:
        expected = _packed_definition(n)
        assert report["ours"][n] == pytest.approx(expected, rel=1e-5), n
    # Stock counts the duplicate accelerate pads in (and averages per-batch means): off where the set is uneven.
    assert abs(report["stock"][7] - _packed_definition(7)) > 1e-4


# ---- Iterable sets each rank reads itself (dispatch_batches=False): every sample counted once -----------------------

STREAM_EVAL_SIZES = (1, 3, 5, 7)
OWN_READS = {"accelerator_config": {"dispatch_batches": False}}  # accelerate's IterableDatasetShard on each rank
DISPATCHED = {"accelerator_config": {"dispatch_batches": True}}  # rank 0 reads and sends each rank its slice


class SizedIterableRows(IterableRows):
    """Iterable rows with a length: accelerate then reports that no sample of the last batch is padding."""

    def __len__(self):
        return len(self.rows)


def _stream_rows(n: int) -> list[dict]:
    # Row 0 of lm_rows is a single token (nothing to predict): skipped, so that every set has items.
    return lm_rows(n + 1, 3)[1:]


def _stream_definition(n: int) -> float:
    """The model's mean loss over every predicted token of the whole set, in one batch on one process."""
    rows = _stream_rows(n)
    whole = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    with torch.no_grad():
        return CASES["llama_causal_lm"].build(0).eval()(**whole).loss.item()


@pytest.mark.parametrize("split_batches", [False, True])
def test_counted_samples_give_the_real_samples_of_a_shards_last_batch(split_batches):
    """On 2 ranks, every set size and batch: each global batch gathered in rank order, the last one cut to what the
    count says is real, is the dataset with each sample once (the layout `gather_samples` relies on)."""
    for n, batch_size in itertools.product(range(1, 10), (2, 4) if split_batches else (1, 2, 3)):
        per_rank, remainders = [], set()
        for rank in (0, 1):
            loader = prepare_data_loader(
                DataLoader(IterableRows(range(n)), batch_size=batch_size), num_processes=2, process_index=rank,
                split_batches=split_batches, dispatch_batches=False,
            )  # fmt: skip
            assert all(hasattr(loader.dataset, name) for name in SHARD_ATTRIBUTES)
            assert count_samples(loader, "eval_dataset") is None
            for _epoch in range(2):  # the count starts again at each epoch
                batches = []
                for batch in loader:
                    batches.append(batch)
                    remainders.add(stream_remainder(loader.gradient_state))
            per_rank.append(batches)
            assert loader.dataset.dataset.count == n
        remainders.discard(None)  # every batch before the last
        assert len(remainders) == 1, (n, batch_size, remainders)
        real = remainders.pop()
        gathered = [torch.cat(pair) for pair in zip(*per_rank, strict=True)]
        if real:
            gathered[-1] = gathered[-1][:real]
        assert torch.cat(gathered).tolist() == list(range(n)), (n, batch_size, real)


def test_samples_read_in_worker_processes_cannot_be_counted_and_say_so(tmp_path, hf_parallel_log):
    trainer = Trainer(model=tiny_bert_classifier(), args=training_args(tmp_path))
    loader = prepare_data_loader(
        DataLoader(IterableRows(range(3)), batch_size=1, num_workers=1), num_processes=2, process_index=0,
        dispatch_batches=False,
    )  # fmt: skip
    for _ in range(2):
        trainer._count_samples(loader, "eval_dataset")
    assert not isinstance(loader.dataset.dataset, SampleCounter)
    warnings = [m for m in hf_parallel_log.messages if "dataloader_num_workers=1" in m]
    assert len(warnings) == 1, hf_parallel_log.messages  # once
    assert "eval_dataset is iterable" in warnings[0] and "dispatch_batches" in warnings[0]


def _stream_report(output_dir: str) -> dict:
    """On each DDP rank: iterable sets each rank reads itself, evaluated and trained, ours and stock."""
    assert dist.get_world_size() == 2
    report = {}
    with record_hf_parallel_log() as log:
        for name, trainer_cls, args_cls, reads in (
            ("ours", Trainer, TrainingArguments, OWN_READS),
            ("ours dispatched", Trainer, TrainingArguments, DISPATCHED),
            ("stock", transformers.Trainer, transformers.TrainingArguments, OWN_READS),
        ):
            args = training_args(
                os.path.join(output_dir, name), args_cls=args_cls, per_device_eval_batch_size=2,
                remove_unused_columns=False, **reads,
            )  # fmt: skip
            trainer = trainer_cls(model=CASES["llama_causal_lm"].build(0), args=args)
            assert trainer.args.parallel_mode == ParallelMode.DISTRIBUTED
            losses = {n: trainer.evaluate(IterableRows(_stream_rows(n)))["eval_loss"] for n in STREAM_EVAL_SIZES}
            losses["sized 7"] = trainer.evaluate(SizedIterableRows(_stream_rows(7)))["eval_loss"]
            labels = trainer.predict(IterableRows(_stream_rows(3))).label_ids
            report[name] = {"losses": losses, "labels": labels}
        # Training: the last step of an epoch holds 1 real row of 8 (9 rows, 2 ranks x 4).
        for name, stock, drop_last in (
            ("train ours", False, False),
            ("train stock", True, False),
            # The Trainer does not pass dataloader_drop_last to an iterable dataset's dataloader: it pads all the same.
            ("train ours drop_last", False, True),
        ):
            result = run_case(
                "bert_single_label", epoch_topology(4, 1), stock=stock, train_rows=9, eval_rows=0,
                dataloader_drop_last=drop_last, **{**EPOCH, **ITERABLE, **OWN_READS},
            )  # fmt: skip
            assert result.world_size == 2 and result.wrapped == "DistributedDataParallel"
            flat = torch.cat([p.flatten() for p in result.params.values()])
            gathered = [torch.empty_like(flat) for _ in range(2)]
            dist.all_gather(gathered, flat)
            assert torch.equal(gathered[0], gathered[1])  # the ranks trained together
            report[name] = dataclasses.replace(result, trainer=None, emulation=None)  # what travels to the test
        report["warnings"] = log.messages
    return report


# ---- The DDP checks of this file, in one spawn of 2 CPU ranks (each spawn costs seconds of imports) ----------------


def _ddp_ranks(output_dir: str) -> None:
    """Body of each rank: every DDP report of this file, torch.compile last; rank 0 saves them."""
    report = {
        "streams": _stream_report(os.path.join(output_dir, "streams")),
        "packed": _packed_eval_report(os.path.join(output_dir, "packed")),
        "compiled": _compiled_after_evaluate(os.path.join(output_dir, "compiled")),
    }
    if dist.get_rank() == 0:
        torch.save(report, os.path.join(output_dir, "report.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_report(tmp_path_factory) -> dict:
    output_dir = tmp_path_factory.mktemp("reach_ddp")
    spawn_cpu_ranks(_ddp_ranks, (str(output_dir),), num_processes=2)
    return torch.load(output_dir / "report.pt", weights_only=False)


@pytest.fixture(scope="module")
def stream_report(ddp_report) -> dict:
    return ddp_report["streams"]


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~12-19 s): .ci/run runs the full step
def test_iterable_evaluation_each_rank_reads_counts_each_sample_once(stream_report):
    for n in STREAM_EVAL_SIZES:
        expected = _stream_definition(n)
        assert stream_report["ours"]["losses"][n] == pytest.approx(expected, rel=1e-5), n
        assert stream_report["ours dispatched"]["losses"][n] == pytest.approx(expected, rel=1e-5), n
    # With a length too, where accelerate reports that nothing is padding.
    assert stream_report["ours"]["losses"]["sized 7"] == pytest.approx(_stream_definition(7), rel=1e-5)
    # Stock counts the samples repeated to fill the last batch (and averages per-batch means): off where uneven.
    for n in (3, 5, 7):
        assert abs(stream_report["stock"]["losses"][n] - _stream_definition(n)) > 1e-4, n
    # Predictions stay as stock has them, the repeated sample included (3 samples, 4 rows): only the loss changes.
    assert stream_report["ours"]["labels"].shape[0] == 4
    assert (stream_report["ours"]["labels"] == stream_report["stock"]["labels"]).all()


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~12-19 s): .ci/run runs the full step
def test_iterable_training_each_rank_reads_trains_the_real_leftover_rows_only(stream_report):
    reference = one_device_epoch("bert_single_label", 9, **ITERABLE)
    ours, stock = stream_report["train ours"], stream_report["train stock"]
    assert len(reference.losses) == 2 and len(ours.losses) == 2  # rows 0-7, then row 8
    assert_losses_close(ours.losses, reference.losses, "iterable, each rank reads")
    assert ours.train_loss == pytest.approx(reference.train_loss, rel=1e-5)
    initial = {n: p.detach() for n, p in CASES["bert_single_label"].build(0).named_parameters()}
    assert update_error(ours.params, reference.params, initial) < 1e-4
    # Stock trains the 7 repeated rows of the last step.
    assert update_error(stock.params, reference.params, initial) > 0.1
    assert not any("cannot be told apart" in m for m in stream_report["warnings"]), stream_report["warnings"]


@pytest.mark.slow
@pytest.mark.full  # a 2-rank spawn (~12-19 s): .ci/run runs the full step
def test_iterable_training_with_dataloader_drop_last_leaves_the_repeats_out_too(stream_report):
    # One process: its iterable dataloader keeps row 8.
    reference = one_device_epoch("bert_single_label", 9, **ITERABLE)
    ours = stream_report["train ours drop_last"]
    assert_losses_close(ours.losses, reference.losses, "iterable, drop_last")
    initial = {n: p.detach() for n, p in CASES["bert_single_label"].build(0).named_parameters()}
    assert update_error(ours.params, reference.params, initial) < 1e-4
