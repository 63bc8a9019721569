"""
The model zoo: every class name of the auto mappings hf_parallel claims a head for (`hf_parallel.exact.resolve`), the
text ones and the non-text ones (images, video, audio, vision-language: `benchmarks.zoo_models.HEAD_KINDS`), built
tiny from its config class (`benchmarks.zoo_models`) with four rows of inputs made in code (`benchmarks.zoo_inputs`),
one optimizer step of 2 rows x gradient accumulation 2 against the model's own loss and gradient on the same 4 rows
in one forward; hf_parallel's Trainer and stock `transformers.Trainer` side by side. Mixture-of-experts causal LMs
run a second time with their router loss on (`moe_causal_lm`), in one step of DataParallel over 2 emulated devices.

    python -m benchmarks.zoo 2>/dev/null                    # the whole zoo (13 min on 2 quiet cores, 35 on busy)
    python -m benchmarks.zoo --kinds ctc speech_seq2seq     # only these kinds (all 16 non-text ones: 11 minutes)
    python -m benchmarks.zoo --shard 0/4                    # a quarter of it
    python -m benchmarks.zoo --classes BartForCausalLM ProphetNetForCausalLM
    python -m benchmarks.zoo --kinds moe_causal_lm zero_shot_image_classification   # the batch-coupled losses

A class whose tiny model, rows and own loss take over `BUILD_SECONDS` to make is unbuildable ("too slow").

Outcomes (a class is counted once):
    exact        the logged loss and the gradient equal the reference (relative difference below `TOL`).
    fallback     hf_parallel warned that it leaves the loss to the Trainer (stock's); listed with the warning.
    silent       neither exact nor warned: a loss silently different from the model's own.
    crash        the Trainer raised where stock trains.
    unbuildable  the tiny model, its inputs or its own loss could not be made (or stock crashes too).
A model whose forward depends on the rest of its batch (batch norm, token-dropping MoE), where no split of the step
can equal one forward, is judged against its own losses on the step's two micro-batches, each weighted by its share of
the items (`Outcome.reference`: "micro-batches"): what one device computes under accumulation.
Stock is shown in the same terms (no warnings: exact, silent or crash).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import signal
import tempfile
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import transformers

import hf_parallel
from benchmarks.zoo_inputs import collate, rows_for
from benchmarks.zoo_models import HEAD_KINDS, ROUTER_KIND, ZooModel, build_model, zoo_models
from hf_parallel.testing import simulate_data_parallel, simulated_training_args

__all__ = ["Outcome", "OUTCOMES", "check_model", "main"]

TOL = 1e-4
BUILD_SECONDS = 60.0  # a class whose tiny model, rows and own loss take longer is unbuildable ("too slow")
OUTCOMES = ("exact", "fallback", "silent", "crash", "unbuildable")
# What hf_parallel's fallback warning says (see hf_parallel.exact.core.ExactLoss.warn_fallback).
_FALLBACK_MARK = "The loss is left to the Trainer"

STEP = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=1,
    optim="sgd",
    learning_rate=0.0,  # the gradient is captured before the step; the weights need not move
    max_grad_norm=0.0,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
    data_seed=0,
    dataloader_num_workers=0,
    remove_unused_columns=False,
    include_num_input_tokens_seen="no",
)
# The step of a MoE model with its router loss on: DataParallel over 2 emulated devices, 2 rows each.
DP_DEVICES = 2
DP_STEP = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1)


@dataclass
class Outcome:
    """What one class gave: `ours` and `stock` are outcome names, `reason` says why a class is not exact."""

    name: str
    kind: str
    ours: str
    stock: str
    reason: str = ""
    #: What the step was judged against: "one forward" over its rows, or "micro-batches" (a forward that depends on
    #: the rest of its batch, batch normalisation's: the model's own loss on each micro-batch, weighted by its items,
    #: which is what one device computes under accumulation too).
    reference: str = "one forward"


class _Capture(transformers.TrainerCallback):
    def __init__(self):
        self.loss, self.grads = None, {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and self.loss is None:
            self.loss = logs["loss"]


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _hf_parallel_warnings():
    handler, logger = _Warnings(), logging.getLogger("hf_parallel")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _relative(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    names = [n for n in a if b[n].numel()]  # a parameter of no elements has no gradient to compare
    scale = max((b[n].abs().max().item() for n in names), default=0.0) or 1.0
    return max(((a[n] - b[n]).abs().max().item() for n in names), default=0.0) / scale


def reference(model: torch.nn.Module, rows: list[dict]) -> tuple[float, dict]:
    """The model's own loss on all rows in one forward, and its gradient."""
    model = copy.deepcopy(model).train()
    loss = model(**collate(rows)).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def batch_dependent(model: torch.nn.Module, rows: list[dict]) -> bool:
    """Whether the first rows' logits change with the rest of the batch (then no split can equal one forward)."""
    model = copy.deepcopy(model).train()
    with torch.no_grad():
        whole = model(**collate(rows))
        part = model(**collate(rows[:2]))
    # A contrastive model's logits score each row against the whole batch by design: its embeddings must not move.
    key = "text_embeds" if "text_embeds" in whole else None
    key = key or next(k for k, v in whole.items() if k != "loss" and isinstance(v, torch.Tensor) and v.dim())
    a, b = whole[key][:2].float(), part[key].float()
    return a.shape != b.shape or bool((a - b).abs().max() > TOL * max(a.abs().max().item(), 1.0))


def random_in_training(model: torch.nn.Module, rows: list[dict]) -> bool:
    """Whether two forwards of the same rows in training mode differ (dropout, noise): no reference is then fixed."""
    model = copy.deepcopy(model).train()
    with torch.no_grad():
        first, second = model(**collate(rows)), model(**collate(rows))
    key = next(k for k, v in first.items() if k != "loss" and isinstance(v, torch.Tensor) and v.dim())
    a, b = first[key].float(), second[key].float()
    return a.shape != b.shape or bool((a - b).abs().max() > TOL * max(a.abs().max().item(), 1.0))


def train_step(
    model: torch.nn.Module, rows: list[dict], stock: bool, data_parallel: bool = False
) -> tuple[float, dict, list[str]]:
    """
    One GA-2 step of hf_parallel's (or stock's) Trainer: its logged loss, gradient and hf_parallel's warnings. With
    `data_parallel`, one step of torch's DataParallel on 2 emulated devices instead (2 rows each, no accumulation): a
    MoE model's router loss is exact over the devices of a step, not over its accumulated micro-batches.
    """
    trainer_cls, args_cls = (
        (transformers.Trainer, transformers.TrainingArguments)
        if stock
        else (hf_parallel.Trainer, hf_parallel.TrainingArguments)
    )
    capture = _Capture()
    emulation = simulate_data_parallel(DP_DEVICES) if data_parallel else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, _hf_parallel_warnings() as log, emulation:
        if data_parallel:
            args = simulated_training_args(DP_DEVICES, args_cls, output_dir=tmp, **{**STEP, **DP_STEP})
        else:
            args = args_cls(output_dir=tmp, **STEP)
        trainer = trainer_cls(
            model=copy.deepcopy(model),
            args=args,
            train_dataset=hf_parallel_rows(rows),
            data_collator=collate,
            callbacks=[capture],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
    return capture.loss, capture.grads, log.messages


def hf_parallel_rows(rows: list[dict]) -> torch.utils.data.Dataset:
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    return Rows()


def _judge(result, ref_loss: float, ref_grads: dict) -> tuple[str, str]:
    """exact / fallback / silent / crash for one training, and why when it is not exact."""
    if isinstance(result, BaseException):
        return "crash", f"{type(result).__name__}: {str(result).splitlines()[0][:200] if str(result) else ''}"
    loss, grads, messages = result
    loss_ratio = loss / ref_loss if ref_loss else float("nan")
    grad_diff = _relative(grads, ref_grads)
    fallback = next((m for m in messages if _FALLBACK_MARK in m), None)
    if fallback is not None:
        return "fallback", fallback.split(" The loss is left")[0][:300]
    if abs(loss - ref_loss) <= TOL * max(abs(ref_loss), 1e-6) and grad_diff <= TOL:
        return "exact", ""
    return "silent", f"loss x{loss_ratio:.4f}, gradient off by {grad_diff:.2e} (relative)"


def _attempt(function, *args):
    try:
        return function(*args)
    except Exception as error:  # a crash is an outcome here, reported by class
        return error


class TooSlow(Exception):
    """Building a tiny model, its rows and its own loss took longer than `BUILD_SECONDS`."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise `TooSlow` in the main thread after `seconds` (SIGALRM; elsewhere, or at 0, no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise TooSlow(f"too slow: over {seconds:.0f} s to build")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_model(zoo_model: ZooModel, build_seconds: float = BUILD_SECONDS) -> Outcome:
    """Build `zoo_model` tiny (within `build_seconds`), and train one GA-2 step with hf_parallel and with stock
    against its own loss."""
    try:
        with _deadline(build_seconds):
            model, rows, ref_loss, ref_grads, judged = _build(zoo_model)
    except Exception as error:
        return Outcome(zoo_model.name, zoo_model.kind, "unbuildable", "unbuildable", _one_line(error))
    data_parallel = zoo_model.kind == ROUTER_KIND
    stock_trained = _attempt(train_step, model, rows, True, data_parallel)
    stock, stock_reason = _judge(stock_trained, ref_loss, ref_grads)
    if stock == "silent" and abs(stock_trained[0] - ref_loss) <= TOL * max(abs(ref_loss), 1e-6):
        stock, stock_reason = _second_look(model, rows, ref_grads, stock_trained[1], stock_reason)
        stock = "silent" if stock == "unbuildable" else stock  # the column of stock has no such outcome
    trained = _attempt(train_step, model, rows, False, data_parallel)
    ours, reason = _judge(trained, ref_loss, ref_grads)
    if ours == "silent" and abs(trained[0] - ref_loss) <= TOL * max(abs(ref_loss), 1e-6):
        ours, reason = _second_look(model, rows, ref_grads, trained[1], reason)
    if ours == "crash" and stock == "crash":
        return Outcome(
            zoo_model.name, zoo_model.kind, "unbuildable", "crash", f"stock crashes too: {stock_reason}", judged
        )
    return Outcome(
        zoo_model.name, zoo_model.kind, ours, stock, reason or (f"stock: {stock_reason}" * (ours != "exact")), judged
    )


def _second_look(model, rows: list[dict], ref_grads: dict, grads: dict, reason: str) -> tuple[str, str]:
    """
    A step whose loss equals the reference and whose gradient does not: is the float32 reference itself that far from
    float64 (a deep, ill-conditioned tiny model), or does the model's forward depend on how the rows are split (its
    own loss on each micro-batch, weighted by its share of the items, gives hf_parallel's gradient)? Else silent.
    """
    with contextlib.suppress(Exception):  # a model that does not run in float64 keeps the first verdict
        exact64 = _reference_float64(model, rows)
        noise = _relative(ref_grads, exact64)
        if _relative(grads, exact64) <= max(TOL, 2 * noise):
            return "exact", f"gradient within the float32 reference's own error ({noise:.1e} from float64)"
    with contextlib.suppress(Exception):
        split = _split_reference(model, rows)
        if _relative(grads, split) <= TOL:
            return "unbuildable", (
                "its forward depends on how the rows are split: its own loss on each micro-batch, weighted by its "
                f"items, gives hf_parallel's gradient ({reason})"
            )
    return "silent", reason


def _reference_float64(model, rows: list[dict]) -> dict:
    """The gradient of the model's own loss on all rows in one forward, in float64."""
    model = copy.deepcopy(model).double().train()
    batch = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in collate(rows).items()}
    model(**batch).loss.backward()
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _split_reference(model, rows: list[dict]) -> dict:
    """The gradient of the model's own loss on the two micro-batches of the step, each weighted by its items."""
    return split_reference(model, rows)[1]


def split_reference(model, rows: list[dict]) -> tuple[float, dict]:
    """
    The model's own loss on the two micro-batches of the step, each weighted by its share of the step's items (a
    summed loss added as it is), and its gradient: what one device computes under gradient accumulation where the
    forward depends on the rest of its batch (batch normalisation's statistics are those of each micro-batch).
    """
    from hf_parallel.exact import resolve_head

    model = copy.deepcopy(model).train()
    batches = [collate(rows[:2]), collate(rows[2:])]
    head = resolve_head(model, sample_labels=batches[0].get("labels"))
    items = [float(head.count({k: b[k] for k in head.label_keys}).sum()) for b in batches]
    total = 0.0
    for batch, share in zip(batches, items, strict=True):
        # A summed loss (CTC's "sum") is added as it is: nothing divides it.
        loss = model(**batch).loss * (1.0 if head.summed else share / sum(items))
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _build(zoo_model: ZooModel) -> tuple[torch.nn.Module, list[dict], float, dict, str]:
    """
    The tiny model, its rows, its own loss and gradient on them, and what they are (`Outcome.reference`): one forward
    over the rows, or, for a forward that depends on the rest of its batch, the micro-batches' own losses (a model
    whose loss hf_parallel does not make exact then has no reference: unbuildable). Raises where any cannot be made.
    """
    model = build_model(zoo_model)
    rows = rows_for(zoo_model, model)
    ref_loss, ref_grads = reference(model, rows)
    if not ref_grads or not torch.isfinite(torch.tensor(ref_loss)):
        raise ValueError(f"the model's own loss is {ref_loss} with {len(ref_grads)} gradients")
    if not batch_dependent(model, rows):
        return model, rows, ref_loss, ref_grads, "one forward"
    if random_in_training(model, rows):
        raise ValueError("its forward draws random numbers in training (a dropout its tiny config leaves on)")
    try:
        ref_loss, ref_grads = split_reference(model, rows)
    except Exception as error:
        raise ValueError(f"its forward depends on the rest of the batch, and {_one_line(error)}") from error
    return model, rows, ref_loss, ref_grads, "micro-batches"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def report(outcomes: list[Outcome]) -> str:
    """The counts for hf_parallel and stock, then every class hf_parallel does not make exact, with its reason."""
    ours, stock = Counter(o.ours for o in outcomes), Counter(o.stock for o in outcomes)
    lines = [f"{len(outcomes)} classes", f"{'':12}" + "".join(f"{name:>12}" for name in OUTCOMES)]
    for label, counts in (("hf_parallel", ours), ("stock", stock)):
        lines.append(f"{label:12}" + "".join(f"{counts.get(name, 0):>12}" for name in OUTCOMES))
    split = [o for o in outcomes if o.reference == "micro-batches"]
    if split:
        counts = Counter(o.ours for o in split)
        lines.append(
            f"of them judged against the micro-batches' own losses (a forward that depends on its batch): {len(split)}"
            f" ({', '.join(f'{counts[name]} {name}' for name in OUTCOMES if counts[name])})"
        )
    for outcome in outcomes:
        if outcome.ours != "exact":
            lines.append(
                f"  {outcome.ours:11} {outcome.name} ({outcome.kind}; stock {outcome.stock}): {outcome.reason}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Outcome]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", nargs="*", help="only these class names")
    parser.add_argument(
        "--kinds", nargs="*", choices=[*HEAD_KINDS, ROUTER_KIND], help="only the classes of these kinds"
    )
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th class from the i-th")
    args = parser.parse_args(argv)
    index, count = (int(part) for part in args.shard.split("/"))
    models = [m for m in zoo_models(args.kinds) if not args.classes or m.name in args.classes][index::count]
    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_parallel").setLevel(logging.WARNING)
    outcomes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for zoo_model in models:
            start = time.perf_counter()
            outcomes.append(check_model(zoo_model))
            seconds = time.perf_counter() - start
            last = outcomes[-1]
            split = " (micro-batches)" if last.reference == "micro-batches" else ""
            print(f"{last.ours:11} {last.stock:11} {seconds:5.1f}s {zoo_model.name}{split}", flush=True)
    print(report(outcomes))
    return outcomes


if __name__ == "__main__":
    main()
