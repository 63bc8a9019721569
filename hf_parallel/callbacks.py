"""Small `TrainerCallback` classes, for users who keep the stock `transformers.Trainer`."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from transformers import PreTrainedModel, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.training_args import ParallelMode
from transformers.utils import logging

from .data_parallel.chunking import balanced_chunk_sizes, gpu0_balance, suggest_gpu0_bsz, torch_chunk_sizes
from .launch.validation import check_whole_number
from .saving.checkpoints import CHECKPOINT_WEIGHT_FILES, checkpoint_weight_files, load_state_dict, stored_keys
from .saving.unwrap import DATA_PARALLEL_CLASSES, has_wrapper_prefixes, unwrap_model

if TYPE_CHECKING:
    from .exact import ExactLoss

logger = logging.get_logger(__name__)


class CleanCheckpointCallback(TrainerCallback):
    """
    Make every checkpoint a stock `transformers.Trainer` saves clean: the unwrapped model's weights, with no
    `module.` or `_orig_mod.` in the keys, in the standard `save_pretrained` layout (`config.json` and
    `model.safetensors`), so `from_pretrained` loads it with no missing keys.

    Stock writes prefixed keys when the model it holds is a wrapper: a model handed to it already wrapped in
    `nn.DataParallel` / DDP, or already compiled with `torch.compile`. After each save this callback checks the
    checkpoint's keys and, when needed, rewrites its weights from the unwrapped model (on the process that saves).
    Resuming a compiled model: stock loads the clean keys into the wrapper non-strictly, matches none of them and keeps
    the initial weights with only a warning; the callback then loads the resumed step's checkpoint (from
    `output_dir`) itself, strictly. A DataParallel/DDP-wrapped model cannot be resumed by stock from a clean
    checkpoint (it fails before any callback runs): hand stock the bare model, which it wraps itself.
    With `hf_parallel.Trainer` the callback is not needed.

    ```python
    import transformers
    from hf_parallel import CleanCheckpointCallback

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[CleanCheckpointCallback()])
    trainer.train()
    ```
    """

    def __init__(self):
        self.rewritten: list[str] = []

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if isinstance(model, DATA_PARALLEL_CLASSES):
            # Stock resume loads the (now clean) checkpoint into the wrapper non-strictly, then fails in
            # `_issue_warnings_after_load` on `'DataParallel' object has no attribute '_keys_to_ignore_on_save'`,
            # before any callback runs.
            logger.warning(
                f"CleanCheckpointCallback: the model was handed to the Trainer wrapped in {type(model).__name__}. "
                "Its checkpoints will be clean, but the stock Trainer cannot resume from them into the wrapper: hand "
                "it the bare model (it wraps it itself on several GPUs), or use hf_parallel.Trainer."
            )

    def on_save(self, args, state, control, model=None, **kwargs):
        if model is None or not args.should_save:
            return
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        stored = checkpoint_weight_files(checkpoint)
        if not stored:
            logger.warning(
                f"CleanCheckpointCallback: no weights found in {checkpoint} (hyper-parameter search runs save "
                "elsewhere); that checkpoint was not checked."
            )
            return
        inner = unwrap_model(model)
        no_config = isinstance(inner, PreTrainedModel) and not os.path.isfile(os.path.join(checkpoint, "config.json"))
        if not has_wrapper_prefixes(stored_keys(stored[0]), inner) and not no_config:
            return
        # on_save runs right after the save of this step, before any other update: the live weights are the saved ones.
        _rewrite_weights(checkpoint, inner)
        self.rewritten.append(checkpoint)
        logger.info(f"CleanCheckpointCallback: rewrote {checkpoint} from the unwrapped {type(inner).__name__}.")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step == 0 or unwrap_model(model) is model:
            return
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if checkpoint_weight_files(checkpoint):
            load_state_dict(model, checkpoint, strict=True)
            logger.info(f"CleanCheckpointCallback: loaded {checkpoint} into the unwrapped {type(model).__name__}.")
        else:
            logger.warning(
                f"CleanCheckpointCallback: resumed at step {state.global_step} into a wrapped model, but "
                f"{checkpoint} does not exist, so the weights could not be checked. Load them with "
                "hf_parallel.load_state_dict(model, checkpoint), or use hf_parallel.Trainer."
            )


def _rewrite_weights(checkpoint: str, inner: torch.nn.Module) -> None:
    """
    Replace the weights of `checkpoint` with `inner`'s, so that a kill at any moment leaves weights there: the new
    files are written into a folder beside them, each moved over its old namesake (`os.replace`, atomic), and only
    then are the old files that the new layout does not have removed.
    """
    old = set(checkpoint_weight_files(checkpoint, shards=True))
    fresh = os.path.join(checkpoint, ".hf_parallel-rewrite")
    shutil.rmtree(fresh, ignore_errors=True)
    os.makedirs(fresh)
    if isinstance(inner, PreTrainedModel):
        inner.save_pretrained(fresh)
    else:
        safetensors.torch.save_model(inner, os.path.join(fresh, CHECKPOINT_WEIGHT_FILES[0]))
    names = sorted(os.listdir(fresh), key=lambda n: n.endswith(".index.json"))  # an index after its shards
    for name in names:
        os.replace(os.path.join(fresh, name), os.path.join(checkpoint, name))
    os.rmdir(fresh)
    for path in old - {os.path.join(checkpoint, name) for name in names}:
        os.remove(path)


# ---- Per-device peak memory and the gpu0_bsz advisor (issue 4) ----


def _data_parallel_devices(args, model: torch.nn.Module | None = None) -> list[int]:
    """
    The CUDA devices this process trains on, one per DataParallel replica (an id repeats where replicas share a GPU):
    the `device_ids` of the DataParallel `model` the Trainer holds when it was handed one; under the wrapper a Trainer
    builds itself (`args.n_gpu > 1`), torch's default, every visible GPU; the process's own GPU under DDP or on one
    GPU; none on CPU.
    """
    if not torch.cuda.is_available():
        return []
    if isinstance(model, torch.nn.DataParallel) and model.device_ids:
        return list(model.device_ids)  # ints: DataParallel.__init__ turns devices into their indices
    if args.n_gpu > 1:
        # Not range(n_gpu): n_gpu may be set above the GPUs there are, e.g. two replicas on one GPU (device_ids
        # [0, 0]), where reading device 1 fails with "invalid device ordinal".
        return list(range(torch.cuda.device_count()))
    device = args.device
    return [device.index or 0] if device.type == "cuda" else []


class PeakMemoryCallback(TrainerCallback):
    """
    Add each GPU's peak allocated memory since the previous log (`torch.cuda.max_memory_allocated`) to every log,
    as `peak_memory_gpu{i}_mib`: under `nn.DataParallel` the GPUs of its `device_ids` (each once), the process's own
    GPU under DDP, nothing on CPU.

    The values go into the `logs` dict and the last `state.log_history` entry, so the callbacks after this one (the
    progress bar, your own) see them. The `report_to` integrations run before callbacks you pass to the Trainer; to
    send the figures to them, put this callback first: `trainer.callback_handler.callbacks.insert(0, callback)`.
    The first logs' peaks include the first steps' own costs: the optimizer state being allocated and, with
    `hf_parallel.Trainer`, the check of its loss head against the model's own loss (usually the first step alone).

    Args:
        reset (`bool`, *optional*, defaults to `True`):
            Reset the peak after each log (`torch.cuda.reset_peak_memory_stats`), so each log gives the peak of its
            own interval; `False` keeps the peak since the start of the process.

    ```python
    from hf_parallel import PeakMemoryCallback, Trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PeakMemoryCallback()])
    ```
    """

    def __init__(self, reset: bool = True):
        self.reset = reset

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        devices = sorted(set(_data_parallel_devices(args, model)))
        if logs is None or not devices:
            return
        peaks = {f"peak_memory_gpu{d}_mib": round(torch.cuda.max_memory_allocated(d) / 2**20, 1) for d in devices}
        if self.reset:
            for d in devices:
                torch.cuda.reset_peak_memory_stats(d)
        logs.update(peaks)
        if state.log_history:
            state.log_history[-1].update(peaks)


def _advice(steps: tuple[int, int], peaks: list[float], rows: list[int], static: float, suggestion: int) -> str:
    """The advisor's warning: the suggestion, or why no `gpu0_bsz` evens the load (`gpu0_balance` below 0 rows)."""
    gib = ", ".join(f"{p / 2**30:.2f}" for p in peaks)
    measured = f"gpu0_bsz advisor: over steps {steps[0]}-{steps[1]} with rows {rows} per GPU, peak memory {gib} GiB"
    balance = gpu0_balance(peaks, rows, static)
    if balance.rows >= 0:
        return f"{measured}; gpu0_bsz={suggestion} should even it out (batches of {sum(rows)} rows)."
    return (
        f"{measured}; no gpu0_bsz evens it out: even gpu0_bsz=0 leaves GPU 0 highest (about "
        f"{balance.gpu0_empty / 2**30:.2f} GiB vs {balance.others_full / 2**30:.2f} GiB on the others with all "
        f"{sum(rows)} rows). Its fixed part (weights, gradients, optimizer state) is the limit, not its rows: use DDP "
        "(`accelerate launch`, one process per GPU, each holding the same), or make that part smaller (e.g. an 8-bit "
        "optimizer). gpu0_bsz=0 comes closest."
    )


def replica_static_bytes(model: torch.nn.Module) -> float:
    """
    The memory a DataParallel replica holds on a GPU other than GPU 0 whatever its rows: its copy of the parameters
    and buffers, and, during backward, a gradient the size of each trainable parameter (before it is sent to GPU 0).
    """
    params = list(model.parameters())
    copies = sum(t.numel() * t.element_size() for t in [*params, *model.buffers()])
    gradients = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return float(copies + gradients)


def _rows_in_use(args, replicas: int) -> list[int]:
    """The rows of each replica in a step: the `gpu0_bsz` / `gpu0_weight` split if set, else torch's chunks."""
    gpu0_bsz, gpu0_weight = getattr(args, "gpu0_bsz", None), getattr(args, "gpu0_weight", None)
    if gpu0_bsz is not None or gpu0_weight is not None:
        return balanced_chunk_sizes(args.train_batch_size, replicas, gpu0_bsz, gpu0_weight)
    rows = torch_chunk_sizes(args.train_batch_size, replicas)
    return rows + [0] * (replicas - len(rows))


class Gpu0BszAdvisorCallback(TrainerCallback):
    """
    Under `nn.DataParallel`, measure each GPU's peak memory over `after_steps` optimizer steps of steady state and log
    the `gpu0_bsz` that would even it out (`hf_parallel.data_parallel.suggest_gpu0_bsz`), once: as a warning and as
    `gpu0_bsz_suggested` in the next log. The steps measured follow the first one (which allocates the optimizer
    state) and, given `exact`, the check of `hf_parallel.Trainer`'s loss head against the model's own loss (whose
    forward keeps the labels and computes the candidate heads, for as long as the check is undecided): the peak
    statistics are reset when they start, so a `PeakMemoryCallback` log of that interval starts there too. The split
    measured is the one in use: `gpu0_bsz` / `gpu0_weight` if set, else torch's even chunks. The
    per-row memory cost is estimated on the other GPUs, net of a replica's static memory (`replica_static_bytes`: its
    parameter and buffer copies, and the gradients of its trainable parameters). When even `gpu0_bsz=0` would leave
    GPU 0 the highest, no value evens the load: the warning says so, with the predicted peaks, and
    `gpu0_bsz_suggested` is 0, the closest value.
    Does nothing on CPU, on one GPU (replicas sharing it included) and under DDP.

    Args:
        after_steps (`int`, *optional*, defaults to 3):
            Optimizer steps to measure, after the first one (and the check, given `exact`).
        exact (`hf_parallel.exact.ExactLoss`, *optional*):
            `trainer.exact` of the `hf_parallel.Trainer` it advises (which sets it at `train()` where it is not
            given): the steps are measured once its check has settled. Without it (a stock Trainer) the check is
            taken to settle in the first step, as it does unless the model's own loss
            cannot tell the candidate heads apart (an untrained model: then for up to 8 steps,
            `hf_parallel.exact.check.MAX_CHECKS`).

    ```python
    from hf_parallel import Gpu0BszAdvisorCallback, Trainer

    advisor = Gpu0BszAdvisorCallback(after_steps=3)
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[advisor]).train()
    advisor.suggestion  # e.g. 11, for TrainingArguments(gpu0_bsz=11)
    ```
    """

    def __init__(self, after_steps: int = 3, exact: ExactLoss | None = None):
        self.after_steps = check_whole_number("after_steps", after_steps, minimum=1)
        self.exact = exact
        self.suggestion: int | None = None
        self.measured: dict | None = None
        self._pending_log = False
        # The optimizer step after which the peaks were reset: the steps measured are the ones that follow it.
        self._since: int | None = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.measured is not None:
            return
        devices = _data_parallel_devices(args, model)
        gpus = len(set(devices))
        if gpus < 2 or gpus < len(devices) or args.parallel_mode != ParallelMode.NOT_DISTRIBUTED:
            self.measured = {}  # nothing to balance (replicas sharing a GPU have one peak between them): decided once
            return
        if self._since is None:
            if self.exact is None or self.exact.checks_settled:
                for d in devices:
                    torch.cuda.reset_peak_memory_stats(d)
                self._since = state.global_step
            return
        if state.global_step - self._since < self.after_steps:
            return
        rows = _rows_in_use(args, len(devices))
        peaks = [float(torch.cuda.max_memory_allocated(d)) for d in devices]
        static = replica_static_bytes(model) if model is not None else 0.0
        steps = (self._since + 1, state.global_step)
        self.measured = {"peaks": peaks, "rows": rows, "static": static, "steps": steps}
        try:
            self.suggestion = suggest_gpu0_bsz(peaks, rows, static)
        except ValueError as reason:
            logger.warning(f"gpu0_bsz advisor: no suggestion ({reason})")
            return
        self._pending_log = True
        logger.warning(_advice(steps, peaks, rows, static, self.suggestion))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending_log and logs is not None:
            self._pending_log = False
            logs["gpu0_bsz_suggested"] = self.suggestion
            if state.log_history:
                state.log_history[-1]["gpu0_bsz_suggested"] = self.suggestion
