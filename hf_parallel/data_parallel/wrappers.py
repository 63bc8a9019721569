"""
Balanced `nn.DataParallel`: GPU 0 gets a smaller share of each batch.

Under `nn.DataParallel`, GPU 0 holds the master weights, the gradients, the optimizer state and the gathered outputs
(and, with the exact loss, computes the loss on them), so with an even split it runs out of memory first while the
other GPUs sit partly empty. `BalancedDataParallel` gives GPU 0 fewer rows (`gpu0_bsz`, or a relative
`gpu0_weight`) and spreads the rest over the other GPUs.

The public versions of this class (transformer-xl's and its copies) use `unit = (bsz - gpu0_bsz) // (n - 1)` and
break on ordinary inputs: one device (`ZeroDivisionError`), `model(**batch)` (`IndexError`), a 0-dim tensor or the
Trainer's `[n_gpu, 1]` `num_items_in_batch` (`quit()`), and they give GPU 0 *more* than `gpu0_bsz` in some cases,
e.g. 10 rows, 3 GPUs, `gpu0_bsz=3` -> `[4, 4, 2]`. The rule here is
`balanced_chunk_sizes` (`hf_parallel.data_parallel.chunking`).

`balanced_wrapper` holds the Trainer's decision of when to wrap a model in `BalancedDataParallel`.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import parallel_apply
from torch.nn.parallel._functions import Scatter
from transformers.training_args import ParallelMode
from transformers.utils import is_sagemaker_mp_enabled, logging

from .chunking import balanced_chunk_sizes, check_split_options
from .replicas import gathering_as_torch
from .replication import replicate_with_routing
from .scatter import batch_rows, scatter_structure

__all__ = ["BalancedDataParallel", "ExactDataParallel", "balanced_wrapper", "with_exact_replicas"]

logger = logging.get_logger(__name__)


class ExactDataParallel(nn.DataParallel):
    """
    `nn.DataParallel` whose replicas give the wrapped model's parameters the gradients one device would: a parameter
    no replica used gets `None`, not torch's zeros (see `hf_parallel.data_parallel.replication`), and
    transformers' `model.device` / `model.dtype` work inside a replica. Everything else is torch's own: the split
    (`tensor.chunk` semantics), the threads, the gather. `hf_parallel.Trainer` wraps a model in it where stock
    wraps it in `nn.DataParallel`.

    ```python
    from hf_parallel import ExactDataParallel

    model = ExactDataParallel(model.cuda())  # same arguments as nn.DataParallel
    ```
    """

    def replicate(self, module: nn.Module, device_ids) -> list[nn.Module]:
        return replicate_with_routing(module, device_ids)


class BalancedDataParallel(ExactDataParallel):
    """
    `nn.DataParallel` that gives GPU 0 fewer rows of each batch than the other GPUs.

    GPU 0 also gathers the outputs and computes the loss, so with an even split it fills up first. Here it gets
    at most `gpu0_bsz` rows (or `gpu0_weight` times another GPU's share), never more than its even share; the
    other GPUs share the rest and differ by at most one row (see `balanced_chunk_sizes`).

    Inputs: positional and keyword arguments (`model(**batch)`) are both split along `dim`. `None`, bools and other
    non-tensors are passed to every device as they are, 0-dim tensors are copied to every device. Any other tensor
    must have the batch size along `dim`: a tensor with another size raises a `ValueError` naming it (torch's own
    `scatter_kwargs` silently drops rows in that case). A device whose share is 0 rows is not used; when that is
    GPU 0, it still holds the master copy of the model and gathers the outputs. An empty batch, or a call without any
    tensor that has a batch dimension, runs once on GPU 0. With one device (or none), it behaves exactly as
    `nn.DataParallel`.

    Attributes the wrapper does not have are looked up on the wrapped model, so `save_pretrained`, `config` and
    `generate` work on the wrapper (they act on the wrapped model, on one device).

    Args:
        module (`nn.Module`):
            The model, its parameters on `device_ids[0]`.
        device_ids (`list[int]`, *optional*):
            CUDA devices, GPU 0 first (defaults to all).
        output_device (`int`, *optional*):
            Where outputs are gathered (defaults to `device_ids[0]`).
        dim (`int`, *optional*, defaults to `0`):
            Batch dimension of the inputs.
        gpu0_bsz (`int`, *optional*):
            Most rows GPU 0 gets from each batch.
        gpu0_weight (`float`, *optional*):
            GPU 0's share relative to each other GPU's, in [0, 1]. Set at most one of the two; with neither the
            split is even (GPU 0 never gets more than another GPU).

    The older form `BalancedDataParallel(gpu0_bsz, model, dim=0)`, with `gpu0_bsz` first, works too.

    ```python
    from hf_parallel import BalancedDataParallel

    model = BalancedDataParallel(model.cuda(), gpu0_bsz=8)  # 8 rows on GPU 0, the rest spread over the others
    outputs = model(**batch)
    model.save_pretrained(output_dir)  # saves the wrapped model, without a `module.` prefix
    ```
    """

    def __init__(self, *args: Any, gpu0_bsz: int | None = None, gpu0_weight: float | None = None, **kwargs: Any):
        # The older form: BalancedDataParallel(gpu0_bsz, model, ...).
        if (
            args
            and not isinstance(args[0], nn.Module)
            and ("module" in kwargs or (len(args) > 1 and isinstance(args[1], nn.Module)))
        ):
            if gpu0_bsz is not None:
                raise ValueError(
                    f"gpu0_bsz given twice: {args[0]!r} as the first argument and {gpu0_bsz!r} by name. Use "
                    "BalancedDataParallel(model, gpu0_bsz=...)."
                )
            gpu0_bsz, args = args[0], args[1:]
        module = args[0] if args else kwargs.get("module")
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"BalancedDataParallel wraps an nn.Module, got {type(module).__name__}. Use "
                "BalancedDataParallel(model, gpu0_bsz=...)."
            )
        check_split_options(gpu0_bsz, gpu0_weight)
        super().__init__(*args, **kwargs)
        self.gpu0_bsz = gpu0_bsz
        self.gpu0_weight = gpu0_weight

    def __getattr__(self, name: str) -> Any:
        # nn.Module.__getattr__ only runs when normal lookup fails; it finds parameters, buffers and submodules.
        # Anything else falls through to the wrapped model (`save_pretrained`, `config`, `generate`), which
        # nn.DataParallel does not do: `nn.DataParallel(model).save_pretrained(...)` raises AttributeError.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def chunk_sizes(self, batch_size: int) -> list[int]:
        """Rows of a batch of `batch_size` rows given to each entry of `device_ids`."""
        return balanced_chunk_sizes(batch_size, len(self.device_ids), self.gpu0_bsz, self.gpu0_weight)

    @gathering_as_torch  # torch's scatter, replicas, parallel_apply and gather: what replicas return arrives as is
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) <= 1:
            return super().forward(*inputs, **kwargs)
        with torch.autograd.profiler.record_function("BalancedDataParallel.forward"):
            _check_module_device(self)
            positions, sizes = self._plan(inputs, kwargs)
            device_ids = [self.device_ids[p] for p in positions]
            # One (positional, keyword) pair per device, unzipped into the two tuples parallel_apply takes; an empty
            # `()` / `{}` is shared, as any non-tensor.
            calls = scatter_structure(
                (tuple(inputs), kwargs),
                len(device_ids),
                split=lambda tensor: Scatter.apply(device_ids, sizes, self.dim, tensor),
                copy=lambda tensor: [tensor.to(torch.device(self.src_device_obj.type, d)) for d in device_ids],
            )
            inputs, module_kwargs = zip(*calls, strict=True)
            # torch's broadcast needs the source device first: when GPU 0 gets no rows, replicate onto it too and
            # drop that replica (replicated without autograd, it costs no gradient;
            # see hf_parallel.data_parallel.replication).
            devices = device_ids if positions[0] == 0 else [self.device_ids[0], *device_ids]
            replicas = self.replicate(self.module, devices)[len(devices) - len(device_ids) :]
            outputs = parallel_apply(replicas, inputs, module_kwargs, device_ids)
            if positions[0] != 0 and self.training:
                _keep_buffers(self.module, replicas[0])
            return self.gather(outputs, self.output_device)

    def _plan(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
        """
        Validate the inputs and split the batch: `(positions, chunk_sizes)`, positions indexing `device_ids` and
        leaving out the devices that get no rows.
        """
        batch_size = batch_rows(inputs, kwargs, self.dim)
        if not batch_size:
            # Nothing to split (an empty batch, or no tensor with a batch dimension): run once, on GPU 0, as on one
            # device. Stock would run every device on a copy of the call (and fail on a 0-dim tensor).
            return [0], [0]
        sizes = self.chunk_sizes(batch_size)
        if self.training and 1 in sizes and _has_batch_norm(self.module):
            logger.warning_once(
                f"BalancedDataParallel: a device gets 1 row of a {batch_size}-row batch (split {sizes}, "
                f"gpu0_bsz={self.gpu0_bsz}, gpu0_weight={self.gpu0_weight}) and the model has BatchNorm layers: "
                "training BatchNorm on one row fails ('Expected more than 1 value per channel') or normalises by "
                "that row alone. Use gpu0_bsz=0 or a split that gives every device at least 2 rows."
            )
        positions = [p for p, size in enumerate(sizes) if size > 0]
        return positions, [sizes[p] for p in positions]


def _has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


@torch.no_grad()
def _keep_buffers(module: nn.Module, replica: nn.Module) -> None:
    # nn.DataParallel keeps the buffer updates of the replica on GPU 0 (its buffers are the module's own), e.g.
    # BatchNorm's running statistics. When GPU 0 gets no rows its replica does not run: keep those of the first
    # replica that ran instead, or they would never update.
    for own, updated in zip(module.buffers(), replica.buffers(), strict=True):
        if own is not updated:
            own.copy_(updated)


def _check_module_device(wrapper: nn.DataParallel) -> None:
    # nn.DataParallel.forward's own check, which the balanced forward replaces.
    for t in chain(wrapper.module.parameters(), wrapper.module.buffers()):
        if t.device != wrapper.src_device_obj:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {wrapper.src_device_obj} "
                f"(device_ids[0]) but found one of them on device: {t.device}"
            )


def balanced_wrapper(
    model: nn.Module, args: Any, accelerator: Any, training: bool = True, model_accepts_loss_kwargs: bool = False
) -> BalancedDataParallel | None:
    """
    The `BalancedDataParallel` a Trainer wraps `model` in for `args.gpu0_bsz` / `args.gpu0_weight`, or `None` when
    the stock wrapping applies: neither option set, not DataParallel (DDP, or one device: warned once, the option
    is ignored), a model already wrapped, SageMaker model parallelism, or an 8-bit/4-bit model.

    Args:
        model (`nn.Module`):
            The model the Trainer is about to wrap.
        args (`hf_parallel.TrainingArguments`):
            The Trainer's arguments.
        accelerator (`accelerate.Accelerator`):
            The Trainer's accelerator (to see through wrappers already applied).
        training (`bool`, *optional*, defaults to `True`):
            Whether the wrap is for training.
        model_accepts_loss_kwargs (`bool`, *optional*, defaults to `False`):
            Whether the stock loss passes `num_items_in_batch` to the model.

    Raises:
        `ValueError`: for training with `exact_loss=False` on a model that accepts loss kwargs: the stock loss then
        passes it an `[n_gpu, 1]` tensor that a balanced split cannot follow.

    ```python
    def _wrap_model(self, model, training=True, dataloader=None):
        wrapped = balanced_wrapper(model, self.args, self.accelerator, training, self.model_accepts_loss_kwargs)
        return wrapped if wrapped is not None else super()._wrap_model(model, training, dataloader)
    ```
    """
    if args.gpu0_bsz is None and args.gpu0_weight is None:
        return None
    setting = f"gpu0_bsz={args.gpu0_bsz}" if args.gpu0_bsz is not None else f"gpu0_weight={args.gpu0_weight}"
    if args.parallel_mode != ParallelMode.NOT_DISTRIBUTED or args.n_gpu <= 1:
        reason = "under DDP each process has its own GPU and batch" if args.world_size > 1 else "one device"
        logger.warning_once(
            f"{setting} is ignored: it balances nn.DataParallel over several GPUs in one process, and this run "
            f"uses {reason} (n_gpu={args.n_gpu}, world_size={args.world_size})."
        )
        return None
    if (
        accelerator.unwrap_model(model, keep_torch_compile=False) is not model  # already wrapped
        or is_sagemaker_mp_enabled()
        or getattr(model, "is_loaded_in_8bit", False)
        or getattr(model, "is_loaded_in_4bit", False)
    ):
        return None
    if training and not args.exact_loss:
        if model_accepts_loss_kwargs:
            # Stock compute_loss passes num_items_in_batch to such models as an [n_gpu, 1] tensor, one row per GPU,
            # which a balanced split cannot scatter (BalancedDataParallel would raise at the first step).
            raise ValueError(
                f"{setting} with exact_loss=False: {type(model).__name__} accepts loss kwargs, so the stock loss "
                "passes it num_items_in_batch as an [n_gpu, 1] tensor, one row per GPU, which a balanced split "
                "cannot follow. Set exact_loss=True (the default) or unset gpu0_bsz/gpu0_weight."
            )
        logger.warning_once(
            f"{setting} with exact_loss=False: the stock loss averages the per-GPU mean losses, which is not the "
            "batch mean when the chunks differ in size, as they do here. Keep exact_loss=True (the default)."
        )
    # Past the DataParallel wrap, stock only adds wrappers for XLA FSDP and SageMaker DP, neither of which runs
    # with n_gpu > 1 in one process, so the wrapped model is final for training and evaluation alike.
    return BalancedDataParallel(model, gpu0_bsz=args.gpu0_bsz, gpu0_weight=args.gpu0_weight)


def with_exact_replicas(wrapped: nn.Module) -> nn.Module:
    """
    The stock Trainer's `nn.DataParallel` wrapper as an `ExactDataParallel` over the same model and devices (so that
    unused parameters get no gradient, as on one device); any other model as it is.
    """
    if type(wrapped) is not nn.DataParallel or not wrapped.device_ids:
        return wrapped
    return ExactDataParallel(wrapped.module, wrapped.device_ids, wrapped.output_device, wrapped.dim)
