"""
`CpuTransport`: a DataParallel wrapper's device work done on the CPU, and the scatter and gather of torch computed on
the CPU (`simulated_scatter`, `simulated_scatter_kwargs`, `simulated_gather`). What the simulation reproduces, and
its limits, are in `hf_parallel.testing.simulation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from ..scatter import _walk_tensors, is_namedtuple, scatter_structure

__all__ = ["CpuTransport", "simulated_gather", "simulated_scatter", "simulated_scatter_kwargs"]

# Virtual devices of a wrapper built without device_ids or n_devices: set by
# hf_parallel.testing.simulate_data_parallel().
active_devices: int | None = None


def simulated_scatter(inputs: Any, num_devices: int, dim: int = 0) -> list[Any]:
    """
    What `torch.nn.parallel.scatter(inputs, list(range(num_devices)), dim)` returns, computed on CPU.

    Tensors are split with `tensor.chunk(num_devices, dim)` (what `comm.scatter` does without chunk sizes), so they
    can give fewer chunks than devices; containers are zipped without `strict`, so the shortest branch wins;
    anything else is repeated once per device.

    Args:
        inputs (`Any`):
            A tensor, or tuples, lists, dicts and namedtuples of them and of other objects.
        num_devices (`int`):
            Virtual devices to split over.
        dim (`int`, *optional*, defaults to `0`):
            Dimension to split tensors along.

    ```python
    import torch
    from hf_parallel.testing import simulated_scatter

    [t.shape[0] for t in simulated_scatter(torch.zeros(5, 2), 4)]  # [2, 2, 1]
    ```
    """

    def chunk(tensor: torch.Tensor):
        return tensor.chunk(num_devices, dim)  # a 0-dim tensor raises here, as in torch's Scatter

    return scatter_structure(inputs, num_devices, split=chunk, copy=chunk, strict=False)


def simulated_scatter_kwargs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, num_devices: int, dim: int = 0
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """
    What `torch.nn.parallel.scatter_gather.scatter_kwargs` returns, computed on CPU, quirks included: positional
    and keyword inputs are scattered separately, then the shorter list is padded with `()` / `{}` (torch compares
    the kwargs list with `len(inputs)`, the number of positional arguments, and this does too).

    Args:
        inputs (`tuple`):
            Positional arguments.
        kwargs (`dict`, *optional*):
            Keyword arguments.
        num_devices (`int`):
            Virtual devices to split over.
        dim (`int`, *optional*, defaults to `0`):
            Dimension to split tensors along.

    ```python
    import torch
    from hf_parallel.testing import simulated_scatter_kwargs

    args, kwargs = simulated_scatter_kwargs((), {"x": torch.zeros(6, 1), "flag": True}, 4)
    len(kwargs)  # 3: six rows chunk into three pieces
    ```
    """
    scattered_inputs = simulated_scatter(inputs, num_devices, dim) if inputs else []
    scattered_kwargs = simulated_scatter(kwargs, num_devices, dim) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def _gather_tensors(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    # torch's Gather: when every input is 0-dim and dim == 0, they are viewed as 1-element vectors first (and
    # torch warns "Was asked to gather along dimension 0, but all input tensors were scalars").
    if dim == 0 and all(t.dim() == 0 for t in tensors):
        tensors = [t.view(1) for t in tensors]
    return torch.cat(list(tensors), dim=dim)


def simulated_gather(outputs: Sequence[Any], dim: int = 0) -> Any:
    """
    What `torch.nn.parallel.gather(outputs, target_device, dim)` returns, computed on CPU: tensors concatenated along
    `dim` (0-dim tensors into a vector), dicts and `ModelOutput`s key by key, namedtuples, tuples and lists element by
    element, `None` stays `None`.

    Args:
        outputs (`Sequence`):
            One output per replica.
        dim (`int`, *optional*, defaults to `0`):
            Dimension to concatenate tensors along.

    ```python
    import torch
    from hf_parallel.testing import simulated_gather

    simulated_gather([torch.tensor(1.0), torch.tensor(2.0)])  # tensor([1., 2.]): the per-device loss vector
    ```
    """

    def gather_map(outputs):
        out = outputs[0]
        if isinstance(out, torch.Tensor):
            return _gather_tensors(outputs, dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outputs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outputs])) for k in out)
        if is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outputs, strict=True)))
        return type(out)(map(gather_map, zip(*outputs, strict=True)))

    return gather_map(outputs)


def _rows(chunk_args: Sequence[Any], chunk_kwargs: dict[str, Any], dim: int) -> int | None:
    for value in (*chunk_args, *chunk_kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > dim:
            return value.size(dim)
    return None


class CpuTransport:
    """
    A DataParallel wrapper's device work over virtual devices, all on the device the module is on (CPU included):
    the transport of `SimulatedDataParallel` and `SimulatedBalancedDataParallel`, with the methods of
    `hf_parallel.transport.CudaTransport`. See the module docstring for what it reproduces and its limits.

    After each forward, `last_chunk_sizes` holds the rows each replica got (from its first tensor argument with a
    batch dimension; `None` for a replica without one), and `last_gathered_bytes` the bytes of the tensors the
    replicas' outputs hold, which DataParallel would bring to the output device (GPU 0).

    Args:
        n_devices (`int`, *optional*):
            Virtual devices when the wrapper is built without `device_ids`; defaults to the ones of the enclosing
            `simulate_data_parallel`.

    ```python
    from hf_parallel import BalancedDataParallel
    from hf_parallel.testing import CpuTransport

    dp = BalancedDataParallel(model, gpu0_bsz=1, transport=CpuTransport(n_devices=3))
    ```
    """

    def __init__(self, n_devices: int | None = None):
        self.n_devices = n_devices
        self.dim = 0
        self.last_chunk_sizes: list[int | None] = []
        self.last_gathered_bytes = 0

    def init_wrapper(
        self, wrapper: nn.DataParallel, module: nn.Module, device_ids: Any, output_device: Any, dim: int
    ) -> None:
        # Not nn.DataParallel.__init__: it looks for real accelerators and, on a CPU-only machine, makes a wrapper
        # that never splits anything.
        nn.Module.__init__(wrapper)
        if device_ids is None:
            n_devices = self.n_devices if self.n_devices is not None else active_devices
            if n_devices is None:
                raise ValueError(
                    "The DataParallel simulation needs a number of virtual devices: pass device_ids or n_devices, or "
                    "build the wrapper inside `with simulate_data_parallel(n_devices):`."
                )
            device_ids = range(n_devices)
        device_ids = [int(d) for d in device_ids]
        if not device_ids:
            raise ValueError("The DataParallel simulation needs at least one virtual device, got device_ids=[].")
        wrapper.module = module
        wrapper.dim = self.dim = dim
        wrapper.device_ids = device_ids
        wrapper.output_device = device_ids[0] if output_device is None else output_device
        first = next(chain(module.parameters(), module.buffers()), None)
        wrapper.src_device_obj = first.device if first is not None else torch.device("cpu")

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int], dim: int):
        scattered = simulated_scatter_kwargs(inputs, kwargs, len(device_ids), dim)
        self._record(*scattered)
        return scattered

    def split(self, tensor: torch.Tensor, device_ids: Sequence[int], chunk_sizes: Sequence[int], dim: int):
        return tensor.split(list(chunk_sizes), dim)

    def copy(self, tensor: torch.Tensor, device_ids: Sequence[int]) -> list[torch.Tensor]:
        return [tensor for _ in device_ids]

    def replicate(self, module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:
        # One module run on every chunk: the chunks' gradients add up in its parameters, as DataParallel's
        # Broadcast backward adds up the replicas' gradients.
        return [module for _ in device_ids]

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any, device_ids: Sequence[int]
    ) -> list[Any]:
        if len(replicas) != len(inputs):
            raise AssertionError(
                f"The number of modules {len(replicas)} is not equal to the number of inputs {len(inputs)}"
            )
        if kwargs is None:
            kwargs = ({},) * len(replicas)
        elif len(replicas) != len(kwargs):
            raise AssertionError(
                f"The number of modules {len(replicas)} is not equal to the number of kwargs_tup {len(kwargs)}"
            )
        self._record(inputs, kwargs)
        outputs = []
        for module, chunk, chunk_kwargs in zip(replicas, inputs, kwargs, strict=True):
            if not isinstance(chunk, (list, tuple)):
                chunk = (chunk,)
            outputs.append(module(*chunk, **chunk_kwargs))
        return outputs

    def gather(self, outputs: Sequence[Any], output_device: Any, dim: int) -> Any:
        gathered = simulated_gather(outputs, dim)
        self.last_gathered_bytes = sum(t.numel() * t.element_size() for _, t in _walk_tensors(gathered, "outputs"))
        return gathered

    def _record(self, inputs: Sequence[Any], kwargs: Sequence[dict[str, Any]]) -> None:
        self.last_chunk_sizes = [_rows(a, k, self.dim) for a, k in zip(inputs, kwargs, strict=False)]
