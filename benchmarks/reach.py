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
from transformers import PrinterCallback

import hf_parallel
from benchmarks.reach_runs import (
    COMMON,
    DDP2,
    GA2,
    GENERATE,
    METRICS,
    OURS,
    SEQ2SEQ,
    STOCK,
    Rows,
    StreamedRows,
    bert,
    both,
    classification_rows,
    crashed,
    packed_loss,
    packed_sequences,
    reference,
    relative_error,
    run,
    update_error,
    whole_loss,
)
from hf_parallel.testing import spawn_cpu_ranks
from tests.helpers.heads import VOCAB, _bart, _lora, llama, lm_rows, seq2seq_rows

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


def ranks_lora() -> dict:
    train, evaluate = Rows(classification_rows(8, 1)), Rows(lm_rows(7, 2))
    return {
        "bert": both(lambda classes: run(LORA_BERT, classes, train, **DDP2)),
        "llama": both(lambda classes: run(LORA_LLAMA, classes, Rows(lm_rows(8, 1)), evaluate, **DDP2)),
    }


def ranks_seq2seq() -> dict:
    return both(lambda c: run(_bart, c, evaluate=Rows(seq2seq_rows(7, 2)), kwargs=METRICS, **GENERATE), SEQ2SEQ)


def ranks_evaluation() -> dict:
    flatten = transformers.DataCollatorWithFlattening()
    streamed = dict(accelerator_config={"dispatch_batches": False})
    return {
        "packed": both(lambda c: run(llama, c, evaluate=Rows(packed_sequences(7)), kwargs={"data_collator": flatten})),
        "streamed": both(lambda c: run(llama, c, evaluate=StreamedRows(lm_rows(7, 2)), **streamed)),
    }


def ranks_compile() -> dict:
    compiled = dict(max_steps=2, per_device_train_batch_size=2, torch_compile=True, torch_compile_backend="eager")
    train, evaluate = Rows(classification_rows(16, 1)), Rows(classification_rows(4, 2))
    return both(lambda c: run(bert, c, train, evaluate, evaluate_first=True, expect_ddp=c is OURS, **compiled))


def ranks_fallback() -> dict:
    train = Rows(classification_rows(8, 1))
    overriding = {"stock": (OverridingStock, STOCK[1]), "ours": (OverridingOurs, OURS[1])}
    return both(lambda c: run(bert, c, train, **DDP2), overriding)


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
    rows = _training_rows(1, "LoRA BERT cls, GA 2", both(lambda c: run(LORA_BERT, c, train, **GA2)), bert_ref)
    lm = both(lambda c: run(LORA_LLAMA, c, Rows(lm_rows(8, 1)), evaluate, **GA2))
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
    one = both(lambda c: run(_bart, c, evaluate=Rows(seq2seq_rows(7, 2)), kwargs=METRICS, **GENERATE), SEQ2SEQ)
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
