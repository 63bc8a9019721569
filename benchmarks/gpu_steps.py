"""
The steps behind `benchmarks/balance_gpu.py`: one configuration (stock `transformers.Trainer` or `hf_parallel.Trainer`,
with or without `gpu0_bsz`) trains a causal LM built from a config under DataParallel (torch's over the chosen
`device_ids`, or the CPU emulation of `hf_parallel.testing` in a dry run); measured are its steady-state peak memory
per GPU and samples per second (`SteadyState`: the steps after the warm-up and after hf_parallel's check of its loss
head) and, with `--search`, the largest per-step batch under a memory cap.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import statistics
import tempfile
import time
import traceback

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import hf_parallel
from hf_parallel.data_parallel.chunking import balanced_chunk_sizes, torch_chunk_sizes
from hf_parallel.exact import ExactLoss

GIB = 2**30
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Config:
    label: str
    stock: bool
    gpu0_bsz: int | None = None


@dataclasses.dataclass
class Result:
    config: Config
    split: list[int]
    wrapper: str = ""
    samples_per_s: float | None = None
    train_loss: float | None = None
    peaks: list[int] = dataclasses.field(default_factory=list)  # bytes, one per physical device, steady state
    warmup_peaks: list[int] = dataclasses.field(default_factory=list)  # bytes, the steps before (the check included)
    since: int | None = None  # the step after which the peaks were reset (None: never, the run stopped before)
    check_settled: bool | None = None  # hf_parallel's check of its loss head then (None: stock, which has none)
    failure: str | None = None  # "out of memory", or the error that stopped the run
    largest: int | None = None
    largest_exact: bool = True


@dataclasses.dataclass
class Bench:
    args: argparse.Namespace
    device_ids: list[int]
    device: torch.device

    @property
    def devices(self) -> list[int]:
        """The physical CUDA devices whose memory is read (none in a dry run)."""
        return [] if self.args.dry_run else sorted(set(self.device_ids))

    @property
    def one_gpu(self) -> bool:
        return len(self.devices) == 1


# ---- The workload ----


def model_config(args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.seq_len,
        use_cache=not args.no_cache,
    )


def build_model(bench: Bench) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same initial weights in every configuration
    with torch.device(bench.device):
        model = LlamaForCausalLM(model_config(bench.args))
    return model.to(DTYPES[bench.args.dtype])


class RandomTokens(torch.utils.data.Dataset):
    """`rows` sequences of random token ids; the labels are a copy (the model shifts them)."""

    def __init__(self, rows: int, seq_len: int, vocab_size: int):
        self.ids = torch.randint(vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class SteadyState(transformers.TrainerCallback):
    """
    Times each optimizer step (the devices synchronised at both ends) and resets the devices' peak memory statistics
    at the end of step `warmup`, and again at the end of each later step while hf_parallel's check of its loss head
    against the model's own loss is undecided (as long as a step remains): the peaks read after training and the
    `times` kept are those of the steps after `since`, steady state. The first step allocates the optimizer state; a
    checked forward keeps the labels in the model's inputs and computes the candidate heads (without autograd, in
    chunks, where the gradient can come from the model's own loss; else each with its graph, a logits-sized buffer
    more per candidate), for up to `MAX_CHECKS` (8) steps on an untrained model whose loss cannot tell them apart.

    Attributes:
        exact (`ExactLoss` or `None`): the Trainer's `exact` (hf_parallel's; stock has no check), set by `train`.
        since (`int` or `None`): the step after which the peaks were last reset (None: not reached).
        check_settled (`bool` or `None`): whether the check had settled then (None: no check, stock).
        warmup_peaks (`list[int]`): per device, the peak of the steps up to `since`.
    """

    def __init__(self, warmup: int, devices: list[int]):
        self.warmup, self.devices = warmup, devices
        self.exact: ExactLoss | None = None
        self.since: int | None = None
        self.check_settled: bool | None = None
        self.warmup_peaks = [0] * len(devices)
        self.step_times: dict[int, float] = {}
        self._start = 0.0

    @property
    def times(self) -> list[float]:
        """Seconds of each step after `since` (after `warmup` when it was not reached)."""
        first = self.warmup if self.since is None else self.since
        return [seconds for step, seconds in self.step_times.items() if step > first]

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.devices)
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.devices)
        step = state.global_step
        self.step_times[step] = time.perf_counter() - self._start
        # At the end of the warm-up, then again while the check is undecided; never at the last step (none would
        # be left to measure).
        due = self.since is None or self.check_settled is False
        if not due or step < self.warmup or step >= state.max_steps:
            return
        for i, d in enumerate(self.devices):
            self.warmup_peaks[i] = max(self.warmup_peaks[i], torch.cuda.max_memory_allocated(d))
            torch.cuda.reset_peak_memory_stats(d)
        self.since = step
        self.check_settled = None if self.exact is None else self.exact.checks_settled


def synchronize(devices: list[int]) -> None:
    for d in devices:
        torch.cuda.synchronize(d)


# ---- Running one configuration through its Trainer ----


@contextlib.contextmanager
def data_parallel_over(device_ids: list[int]):
    """
    Within the block, a DataParallel wrapper built without `device_ids` (as both Trainers build theirs) spans
    `device_ids`, a repeated id included: torch fills them in from `_get_all_device_indices`, looked up at call time.
    """
    module = importlib.import_module("torch.nn.parallel.data_parallel")
    if not callable(getattr(module, "_get_all_device_indices", None)):
        raise SystemExit(
            f"torch {torch.__version__} has no torch.nn.parallel.data_parallel._get_all_device_indices, which this "
            "benchmark replaces to set the Trainers' device_ids: run it with torch 2.x as pinned by the project."
        )
    saved = module._get_all_device_indices
    module._get_all_device_indices = lambda: list(device_ids)
    try:
        yield
    finally:
        module._get_all_device_indices = saved


def parallel(bench: Bench):
    """The DataParallel of the run: torch's over `bench.device_ids`, on virtual CPU devices in a dry run."""
    if bench.args.dry_run:
        from hf_parallel.testing import simulate_data_parallel

        return simulate_data_parallel(len(bench.device_ids))
    return data_parallel_over(bench.device_ids)


def make_trainer(config: Config, bench: Bench, model, batch: int, max_steps: int, output_dir: str, callbacks=()):
    library = transformers if config.stock else hf_parallel
    n = len(bench.device_ids)
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch // n,
        max_steps=max_steps,
        learning_rate=1e-5,
        logging_steps=max_steps + 1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    if config.gpu0_bsz is not None:
        kwargs["gpu0_bsz"] = config.gpu0_bsz
    if bench.args.dry_run:
        from hf_parallel.testing import simulated_training_args

        training_args = simulated_training_args(n, library.TrainingArguments, **kwargs)
    else:
        training_args = library.TrainingArguments(**kwargs)
        _ = training_args._setup_devices  # cached: n_gpu is computed here once, then set to the replicas' count
        training_args._n_gpu = n
    data = RandomTokens(batch * max_steps, bench.args.seq_len, bench.args.vocab_size)
    trainer = library.Trainer(model=model, args=training_args, train_dataset=data, callbacks=list(callbacks))
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no metrics line per run
    return trainer


def train(
    config: Config, bench: Bench, model, batch: int, max_steps: int, steady: SteadyState | None = None
) -> tuple[float, str]:
    """
    `max_steps` steps of `batch` rows through the configuration's Trainer, timed and measured by `steady` if given
    (which then watches hf_parallel's check): the mean loss and the wrapper's name.
    """
    with tempfile.TemporaryDirectory() as output_dir, parallel(bench):
        trainer = make_trainer(config, bench, model, batch, max_steps, output_dir, [] if steady is None else [steady])
        if steady is not None:
            steady.exact = getattr(trainer, "exact", None)  # hf_parallel's ExactLoss; the stock Trainer has none
        output = trainer.train()
        return output.training_loss, type(trainer.model_wrapped).__name__


def is_out_of_memory(error: BaseException) -> bool:
    # DataParallel re-raises a replica's error in the main thread; cuBLAS reports its own failed allocations.
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def release(devices: list[int], model=None) -> None:
    """Free what a run left behind (gradients, the Trainer's optimizer state in reference cycles, cached blocks)."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if devices:
        torch.cuda.empty_cache()


def split_of(config: Config, batch: int, n: int) -> list[int]:
    if config.gpu0_bsz is None:
        sizes = torch_chunk_sizes(batch, n)
        return sizes + [0] * (n - len(sizes))
    return balanced_chunk_sizes(batch, n, gpu0_bsz=config.gpu0_bsz)


def measure(config: Config, bench: Bench) -> Result:
    args, devices = bench.args, bench.devices
    result = Result(config, split_of(config, args.batch_size, len(bench.device_ids)))
    for d in devices:
        if torch.cuda.memory_allocated(d) > GIB / 4:  # a leak of the previous configuration would count here
            held = torch.cuda.memory_allocated(d) / GIB
            print(f"note: {held:.2f} GiB still allocated on GPU {d} before {config.label} (counted in its peak)")
    model = build_model(bench)
    steady = SteadyState(args.warmup, devices)
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    try:
        result.train_loss, result.wrapper = train(
            config, bench, model, args.batch_size, args.warmup + args.steps, steady
        )
        result.samples_per_s = args.batch_size / statistics.median(steady.times)
    except Exception as error:  # one configuration's failure must not lose the others' figures
        result.failure = "out of memory" if is_out_of_memory(error) else f"{type(error).__name__} (see stderr)"
        if result.failure != "out of memory":
            traceback.print_exc()
    # Read after a failure too: how far it got (since None: from the start, the warm-up included).
    result.peaks = [torch.cuda.max_memory_allocated(d) for d in devices]
    result.warmup_peaks, result.since, result.check_settled = steady.warmup_peaks, steady.since, steady.check_settled
    release(devices, model)
    if args.search and result.failure is None:
        result.largest, result.largest_exact = largest_batch(config, bench, model)
    del model
    release(devices)
    return result


# ---- The largest batch under a memory cap ----


def fits(config: Config, bench: Bench, model, batch: int) -> bool:
    try:
        train(config, bench, model, batch, max_steps=2)  # the second step runs with the optimizer state allocated
        fitted = True
    except RuntimeError as error:
        if not is_out_of_memory(error):
            raise
        fitted = False
    # After the except block, so that the traceback (and the activations its frames hold) is gone.
    release(bench.devices, model)
    return fitted


def largest_batch(config: Config, bench: Bench, model) -> tuple[int, bool]:
    """The largest per-step batch under the cap, and whether the bisection finished within its time bound."""
    args, n = bench.args, len(bench.device_ids)
    for d in bench.devices:  # the cap applies to the search only
        total = torch.cuda.get_device_properties(d).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), d)
    # Rows per device: `low` fits (0 trivially), `high` does not. hf_parallel refuses a gpu0_bsz above the per-device
    # batch (GPU 0's even share), so the search starts there.
    floor = config.gpu0_bsz or 0
    low, high = 0, max(args.max_batch // n, floor) + 1
    deadline = time.monotonic() + args.search_seconds
    try:
        if floor:
            if not fits(config, bench, model, floor * n):
                return 0, True
            low = floor
        while high - low > 1 and time.monotonic() < deadline:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(config, bench, model, middle * n) else (low, middle)
    finally:
        for d in bench.devices:
            torch.cuda.set_per_process_memory_fraction(1.0, d)
    return low * n, high - low <= 1
