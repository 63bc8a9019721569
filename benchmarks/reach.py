"""
Before and after, for each numbered case of the "reach" issue (PEFT adapters, Trainer subclasses, packed and streamed
evaluation, torch.compile, fallbacks), measured in one run on CPU: DDP with 2 real gloo ranks (one spawn for every
DDP run), everything else in this process.

    python -m benchmarks.reach 2>/dev/null           # cases 1-6 (about 1.5 minutes on 2 busy cores)
    python -m benchmarks.reach --cases 1 4           # a subset
    python -m benchmarks.reach --cases 1 --no-ddp    # only what runs in one process

Every training is one plain SGD step (learning rate 0.5, no clipping, no decay) of tiny models built from configs
on rows made in code. The reference is one process on the whole batch, by hand: the model's own loss on all rows
at once, `p -= lr * grad`; its eval_loss is the model's loss on the whole evaluation set in one batch, i.e. the sum
of the item losses over the number of items, each sample counted once.

Columns:
    case         the number of the case in the issue.
    setup        model, topology (GA 2: one process, gradient accumulation 2; DDP 2: two ranks) and what is tried.
    figure       what the two cells measure: "loss / ref" is the logged training loss over the reference's;
                 "update err" is max |params - reference params| / max |reference update|; "eval_loss err" and
                 "loss err" are |value - reference| / |reference|; "ranks apart" is the largest parameter
                 difference between the two ranks after training; other figures are what was observed, in words.
    before       stock: transformers' Trainer / Seq2SeqTrainer, TRL's SFTTrainer combined by hand with
                 `hf_parallel.Trainer` (case 3, as the issue found it), each with what the case changes.
    after        hf_parallel: Trainer, Seq2SeqTrainer, `TrainerMixin` (case 3), in the same run.

Every DDP run asserts inside the ranks that it runs on 2 ranks in distributed mode and, where it trains, that the
model it trains is wrapped in DDP (all but stock in case 5, whose missing wrapper is the symptom measured).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel
from transformers import BertConfig, PrinterCallback
from transformers.training_args import ParallelMode

import hf_parallel
from hf_parallel.testing import spawn_cpu_ranks
from tests.heads import VOCAB, _bart, _lora, _padded, llama, lm_rows, seq2seq_rows

LR = 0.5
STOCK = (transformers.Trainer, transformers.TrainingArguments)
OURS = (hf_parallel.Trainer, hf_parallel.TrainingArguments)
# One SGD step that applies the gradient as it is, so that a wrong scale shows in the weights.
COMMON = dict(
    report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, max_steps=1,
    optim="sgd", learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
    logging_steps=1, per_device_eval_batch_size=2, dataloader_num_workers=0, remove_unused_columns=False,
    include_num_input_tokens_seen="no",
)  # fmt: skip
SEQ2SEQ = {
    "stock": (transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments),
    "ours": (hf_parallel.Seq2SeqTrainer, hf_parallel.Seq2SeqTrainingArguments),
}
GENERATE = dict(predict_with_generate=True, generation_max_length=6)


def generated_rows(prediction: transformers.EvalPrediction) -> dict:
    return {"generated_rows": len(prediction.predictions)}


# A metric, so that evaluate() generates: without `compute_metrics` it computes the loss only and never generates.
METRICS = {"compute_metrics": generated_rows}

GA2 = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)
DDP2 = dict(per_device_train_batch_size=4)  # 8 rows in one step on 2 ranks

# ---- Tiny models and rows (uneven valid items per row, and rows without any, so that a wrong average shows) ----


def bert(seed: int, num_labels: int = 3):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def classification_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids, mask = _padded(g, n)
    labels = torch.randint(0, 3, (n,), generator=g)
    labels[0] = -100  # an ignored sample
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def packed_sequences(n: int) -> list[dict]:
    """Unpadded causal LM sequences for `DataCollatorWithFlattening`, each with at least one token to predict."""
    sequences = [r["input_ids"][r["attention_mask"].bool()].tolist() for r in lm_rows(n + 1, 3)[1:]]
    return [{"input_ids": ids, "labels": ids} for ids in sequences]


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class StreamedRows(torch.utils.data.IterableDataset):
    """The rows as an iterable dataset (no length)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


# ---- The reference: one process on the whole batch, by hand ----


def whole_loss(model, rows: list[dict]) -> float:
    """The model's loss on all `rows` in one batch: every item counted once."""
    model.eval()
    with torch.no_grad():
        return model(**{key: torch.stack([row[key] for row in rows]) for key in rows[0]}).loss.item()


def packed_loss(model, rows: list[dict]) -> float:
    """Sum of the token losses over the count of predicted tokens, sequence by sequence."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logits = model.eval()(input_ids=ids).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference(build, train: list[dict], evaluate: list[dict] | None = None) -> dict:
    """One SGD step of one process on all `train` rows, then the loss on all `evaluate` rows."""
    model = build(0).train()
    initial = parameters(model)
    loss = model(**{key: torch.stack([row[key] for row in train]) for key in train[0]}).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    eval_loss = whole_loss(model, evaluate) if evaluate else None
    return {"loss": loss.item(), "params": parameters(model), "initial": initial, "eval_loss": eval_loss}


def relative_error(value: float, expected: float) -> float:
    return abs(value - expected) / abs(expected)


def update_error(params: dict, ref: dict) -> float:
    update = max((ref["params"][n] - ref["initial"][n]).abs().max().item() for n in params)
    return max((params[n] - ref["params"][n]).abs().max().item() for n in params) / update


# ---- One Trainer run (in this process or in a DDP rank) ----


def check_topology(trainer) -> None:
    """Inside a DDP rank: two ranks, in distributed mode, so that a mis-launch cannot pass as a measurement."""
    assert dist.get_world_size() == 2 and trainer.args.world_size == 2, trainer.args.world_size
    assert trainer.args.parallel_mode == ParallelMode.DISTRIBUTED, trainer.args.parallel_mode


def trained(trainer, expect_ddp: bool) -> dict:
    """The logged losses and parameters of a trained `trainer`; under DDP also the model it trained (asserted to be
    DDP when `expect_ddp`) and how far the ranks' parameters are apart."""
    params = parameters(trainer.accelerator.unwrap_model(trainer.model))
    result = {"loss": [log["loss"] for log in trainer.state.log_history if "loss" in log], "params": params}
    if dist.is_initialized():
        inner = getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped)  # inside torch.compile's wrapper
        assert isinstance(inner, DistributedDataParallel) or not expect_ddp, type(inner).__name__
        flat = torch.cat([p.flatten() for p in params.values()])
        gathered = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(gathered, flat)
        result.update(wrapper=type(inner).__name__, apart=(gathered[0] - gathered[1]).abs().max().item())
    return result


def run(build, classes, train=None, evaluate=None, *, evaluate_first=False, expect_ddp=True, kwargs=None, **args):
    """
    Train `build(0)` with `classes` (a Trainer and its arguments class; `COMMON`, then `args`, and `kwargs` for the
    Trainer) on `train`, then evaluate on `evaluate` (before training with `evaluate_first`): what `trained` gives,
    and eval_loss.
    """
    trainer_cls, args_cls = classes
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = args_cls(output_dir=tmp, **{**COMMON, **args})
        trainer = trainer_cls(model=build(0), args=args, train_dataset=train, eval_dataset=evaluate, **(kwargs or {}))
        trainer.remove_callback(PrinterCallback)
        if dist.is_initialized():
            check_topology(trainer)
        if evaluate is not None and evaluate_first:
            result["eval_loss"] = trainer.evaluate()["eval_loss"]
        if train is not None:
            trainer.train()
            result.update(trained(trainer, expect_ddp))
        if evaluate is not None and not evaluate_first:
            result["eval_loss"] = trainer.evaluate()["eval_loss"]
    return result


# ---- The cases: what runs in the DDP ranks, then the rows of the table ----

LORA_BERT = _lora(bert, "SEQ_CLS", ["query", "value"])
LORA_LLAMA = _lora(llama, "CAUSAL_LM", ["q_proj", "v_proj"])


class PassThroughLoss:
    """A Trainer subclass's `compute_loss` override, as users write them (here it only calls the parent's)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class OverridingStock(PassThroughLoss, transformers.Trainer):
    pass


class OverridingOurs(PassThroughLoss, hf_parallel.Trainer):
    pass


def crashed(error: Exception) -> str:
    return f"crash: {type(error).__name__}: {error}"[:72]


def _both(run_one, sides: dict | None = None) -> dict:
    """`run_one(classes)` for stock and for hf_parallel: side -> its result, or the crash in words."""
    results = {}
    for side, classes in (sides or {"stock": STOCK, "ours": OURS}).items():
        try:
            results[side] = run_one(classes)
        except AssertionError:  # a wrong topology is no figure: fail
            raise
        except Exception as error:  # a crash is a figure too (under DDP both ranks raise alike)
            results[side] = crashed(error)
    return results


def ranks_lora() -> dict:
    train, evaluate = Rows(classification_rows(8, 1)), Rows(lm_rows(7, 2))
    return {
        "bert": _both(lambda classes: run(LORA_BERT, classes, train, **DDP2)),
        "llama": _both(lambda classes: run(LORA_LLAMA, classes, Rows(lm_rows(8, 1)), evaluate, **DDP2)),
    }


def ranks_seq2seq() -> dict:
    return _both(lambda c: run(_bart, c, evaluate=Rows(seq2seq_rows(7, 2)), kwargs=METRICS, **GENERATE), SEQ2SEQ)


def ranks_evaluation() -> dict:
    flatten = transformers.DataCollatorWithFlattening()
    streamed = dict(accelerator_config={"dispatch_batches": False})
    return {
        "packed": _both(
            lambda c: run(llama, c, evaluate=Rows(packed_sequences(7)), kwargs={"data_collator": flatten})
        ),
        "streamed": _both(lambda c: run(llama, c, evaluate=StreamedRows(lm_rows(7, 2)), **streamed)),
    }


def ranks_compile() -> dict:
    compiled = dict(max_steps=2, per_device_train_batch_size=2, torch_compile=True, torch_compile_backend="eager")
    train, evaluate = Rows(classification_rows(16, 1)), Rows(classification_rows(4, 2))
    return _both(lambda c: run(bert, c, train, evaluate, evaluate_first=True, expect_ddp=c is OURS, **compiled))


def ranks_fallback() -> dict:
    train = Rows(classification_rows(8, 1))
    overriding = {"stock": (OverridingStock, STOCK[1]), "ours": (OverridingOurs, OURS[1])}
    return _both(lambda c: run(bert, c, train, **DDP2), overriding)


RANK_JOBS = {1: ranks_lora, 2: ranks_seq2seq, 4: ranks_evaluation, 5: ranks_compile, 6: ranks_fallback}


@dataclass
class Row:
    case: int
    setup: str
    figure: str
    before: float | str
    after: float | str


def _row(case: int, setup: str, figure: str, results: dict, measure) -> Row:
    """A row of `measure(result)` for stock and hf_parallel; a crash stays the words that describe it."""
    cells = [result if isinstance(result, str) else measure(result) for result in (results["stock"], results["ours"])]
    return Row(case, setup, figure, *cells)


def _training_rows(case: int, setup: str, results: dict, ref: dict) -> list[Row]:
    return [
        _row(case, setup, "loss / ref", results, lambda result: result["loss"][0] / ref["loss"]),
        _row(case, setup, "update err", results, lambda result: update_error(result["params"], ref)),
    ]


def _eval_row(case: int, setup: str, results: dict, expected: float) -> Row:
    return _row(case, setup, "eval_loss err", results, lambda result: relative_error(result["eval_loss"], expected))


def case_lora(ddp: dict | None) -> list[Row]:
    """1. PEFT: LoRA on a BERT classifier (loss, update) and on a Llama LM (eval_loss after the step)."""
    bert_ref = reference(LORA_BERT, classification_rows(8, 1))
    llama_ref = reference(LORA_LLAMA, lm_rows(8, 1), lm_rows(7, 2))
    train, evaluate = Rows(classification_rows(8, 1)), Rows(lm_rows(7, 2))
    rows = _training_rows(1, "LoRA BERT cls, GA 2", _both(lambda c: run(LORA_BERT, c, train, **GA2)), bert_ref)
    lm = _both(lambda c: run(LORA_LLAMA, c, Rows(lm_rows(8, 1)), evaluate, **GA2))
    rows.append(_eval_row(1, "LoRA Llama LM, GA 2", lm, llama_ref["eval_loss"]))
    if ddp is not None:
        rows += _training_rows(1, "LoRA BERT cls, DDP 2", ddp["bert"], bert_ref)
        rows.append(_eval_row(1, "LoRA Llama LM, DDP 2", ddp["llama"], llama_ref["eval_loss"]))
    return rows


def _seq2seq_args_kept(trainer_cls) -> str:
    """What `trainer_cls` keeps of a `transformers.Seq2SeqTrainingArguments` given to it."""
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.Seq2SeqTrainingArguments(output_dir=tmp, **{**COMMON, **GENERATE})
        trainer = trainer_cls(model=_bart(0), args=args)
    saved = trainer.args.to_dict()
    kept = getattr(trainer.args, "predict_with_generate", None) is True and saved.get("predict_with_generate")
    extra = f", exact_loss={saved['exact_loss']}" if "exact_loss" in saved else ""
    return f"{type(trainer.args).__name__}: {'kept' if kept else 'LOST'}{extra}"


def case_seq2seq(ddp: dict | None) -> list[Row]:
    """2. Seq2SeqTrainer: its arguments kept; eval_loss with predict_with_generate=True."""
    kept = [_seq2seq_args_kept(SEQ2SEQ[side][0]) for side in ("stock", "ours")]
    rows = [Row(2, "Seq2SeqTrainingArguments(predict_with_generate=True)", "predict_with_generate", *kept)]
    expected = whole_loss(_bart(0), seq2seq_rows(7, 2))
    one = _both(lambda c: run(_bart, c, evaluate=Rows(seq2seq_rows(7, 2)), kwargs=METRICS, **GENERATE), SEQ2SEQ)
    rows.append(_eval_row(2, "BART, predict_with_generate, 1 process", one, expected))
    if ddp is not None:
        rows.append(_eval_row(2, "BART, predict_with_generate, DDP 2", ddp, expected))
    return rows


def _sft(trainer_cls) -> list[dict] | str:
    """TRL's SFTTrainer (or a class built on it) with loss_type="dft", 2 steps: its logs, or the crash."""
    import datasets
    from tokenizers import Tokenizer, models
    from trl import SFTConfig

    datasets.disable_progress_bars()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1")),
        pad_token="w0", unk_token="w1",
    )  # fmt: skip
    texts = [r["input_ids"][r["attention_mask"].bool()].tolist() for r in lm_rows(8, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(
            output_dir=tmp, max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True, loss_type="dft",
            logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
        )  # fmt: skip
        try:
            trainer = trainer_cls(
                model=llama(0), args=args, processing_class=tokenizer,
                train_dataset=datasets.Dataset.from_list([{"input_ids": ids} for ids in texts]),
            )  # fmt: skip
            trainer.remove_callback(PrinterCallback)
            trainer.train()
        except Exception as error:  # the symptom measured: a crash at construction (or in training)
            return crashed(error)
    return [log for log in trainer.state.log_history if "loss" in log]


def case_trl(ddp: dict | None) -> list[Row]:
    """3. TRL's SFTTrainer: hand combination (before) and TrainerMixin (after), against TRL alone."""
    from trl import SFTTrainer

    hand = type("T", (hf_parallel.Trainer, SFTTrainer), {})
    mixin = type("T", (hf_parallel.TrainerMixin, SFTTrainer), {})
    alone, runs = _sft(SFTTrainer), [_sft(hand), _sft(mixin)]
    trl_loss = [log["loss"] for log in alone]

    def cells(measure) -> list:
        return [logs if isinstance(logs, str) else measure(logs) for logs in runs]

    def loss_error(logs: list[dict]) -> float:
        return max(relative_error(log["loss"], ref) for log, ref in zip(logs, trl_loss, strict=True))

    def extra_logs(logs: list[dict]) -> str:
        absent = [key for key in ("entropy", "mean_token_accuracy") if key not in logs[0]]
        return f"missing: {', '.join(absent)}" if absent else "present"

    return [
        Row(3, "SFTTrainer, Llama: by hand / TrainerMixin", "constructs and trains", *cells(lambda logs: "yes")),
        Row(3, f'loss_type="dft" (TRL alone logs {trl_loss[0]:.3g})', "loss err vs TRL", *cells(loss_error)),
        Row(3, "TRL's entropy, mean_token_accuracy", "in the logs", *cells(extra_logs)),
    ]


def case_evaluation(ddp: dict | None) -> list[Row]:
    """4. Evaluation under DDP of rows that are not samples: packed batches, an iterable set without dispatch."""
    if ddp is None:
        return []
    return [
        _eval_row(4, "Llama, packed (DataCollatorWithFlattening), 7 seq, DDP 2", ddp["packed"],
                  packed_loss(llama(0), packed_sequences(7))),
        _eval_row(4, "Llama, iterable eval set, dispatch_batches=False, 7 rows, DDP 2", ddp["streamed"],
                  whole_loss(llama(0), lm_rows(7, 2))),
    ]  # fmt: skip


def case_compile(ddp: dict | None) -> list[Row]:
    """5. torch_compile=True, evaluate() before train(), DDP 2: are the ranks still equal after 2 steps?"""
    if ddp is None:
        return []
    setup = "BERT cls, torch_compile, evaluate() first, DDP 2"
    return [_row(5, setup, "ranks apart", ddp, lambda result: f"{result['apart']:.1e} ({result['wrapper']})")]


@contextlib.contextmanager
def recorded_warnings():
    """The WARNING records of transformers' and hf_parallel's loggers in the block, not printed."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("transformers", "hf_parallel")]
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
    try:
        yield records
    finally:
        for logger, (level, propagate) in zip(loggers, saved, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


def _startup_message(classes) -> str:
    with recorded_warnings() as records, tempfile.TemporaryDirectory() as tmp:
        args = classes[1](output_dir=tmp, average_tokens_across_devices=False, **COMMON)
        classes[0](model=bert(0), args=args, train_dataset=Rows(classification_rows(4, 1)))
    said = [r.getMessage() for r in records if "average_tokens_across_devices" in r.getMessage()]
    return f'"{said[0][:60]}..."' if said else "none"


def case_fallback(ddp: dict | None) -> list[Row]:
    """6. A fallback to stock (a subclass's compute_loss) under DDP 2; average_tokens_across_devices=False."""
    rows = []
    if ddp is not None:
        ref = reference(bert, classification_rows(8, 1))
        rows += _training_rows(6, "BERT cls, subclass overrides compute_loss, DDP 2", ddp, ref)
    setup = "average_tokens_across_devices=False (exact_loss on)"
    return [*rows, Row(6, setup, "start-up message", _startup_message(STOCK), _startup_message(OURS))]


CASES = {1: case_lora, 2: case_seq2seq, 3: case_trl, 4: case_evaluation, 5: case_compile, 6: case_fallback}


# ---- Running and printing ----


def quiet() -> None:
    """No warnings or per-step output in the table (here and in the ranks, which are fresh processes)."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_parallel").setLevel(logging.ERROR)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false")


def rank_worker(cases: list[int], out_dir: str) -> None:
    """Body of each DDP rank: the rank jobs of `cases`; rank 0 saves their results."""
    quiet()
    torch.set_num_threads(1)  # two ranks on two cores
    results = {case: RANK_JOBS[case]() for case in cases}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


def measure(cases: list[int], ddp: bool = True) -> list[Row]:
    """The rows of `cases`: their DDP runs in one spawn of 2 CPU ranks (none if not `ddp`), then the rest."""
    in_ranks = [case for case in cases if case in RANK_JOBS] if ddp else []
    results = {}
    if in_ranks:
        with tempfile.TemporaryDirectory() as tmp:
            spawn_cpu_ranks(rank_worker, (in_ranks, tmp), num_processes=2, timeout=300)
            results = torch.load(os.path.join(tmp, "results.pt"), weights_only=False)
    return [row for case in cases for row in CASES[case](results.get(case))]


def cell(value: float | str, figure: str) -> str:
    if isinstance(value, str):
        return value
    return f"x{value:.3f}, err {abs(value - 1):.1e}" if figure == "loss / ref" else f"{value:.1e}"


def print_table(rows: list[Row]) -> None:
    table = [("case", "setup", "figure", "before", "after")]
    table += [(str(r.case), r.setup, r.figure, cell(r.before, r.figure), cell(r.after, r.figure)) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(5)]
    for i, line in enumerate(table):
        print(" | ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            print("-+-".join("-" * width for width in widths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases", type=int, nargs="+", choices=sorted(CASES), default=sorted(CASES), help="the issue's case numbers"
    )
    parser.add_argument("--no-ddp", action="store_true", help="skip the runs on 2 DDP ranks")
    options = parser.parse_args()
    quiet()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print_table(measure(sorted(set(options.cases)), ddp=not options.no_ddp))


if __name__ == "__main__":
    main()
