"""
The device work of a `DataParallel` wrapper, as an object the wrapper is given: a transport.

`nn.DataParallel` splits a call over devices, copies the module to each, runs the copies in parallel and gathers
their outputs; all of that touches devices. `TransportDataParallel` is `nn.DataParallel` with that work delegated to
a transport, `CudaTransport` (torch's own functions) by default, so that a wrapper built on it (such as
`BalancedDataParallel`) runs unchanged over any transport with the same methods, e.g. one that runs every "device"
on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import parallel_apply, replicate
from torch.nn.parallel._functions import Scatter
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

__all__ = ["CudaTransport", "TransportDataParallel", "route_gradients_to"]


class CudaTransport:
    """
    The device work of a `DataParallel` wrapper, done by torch's own functions: what `nn.DataParallel` does on
    accelerators, plus a split with given chunk sizes.

    Another transport has the same methods. One transport serves one wrapper: `init_wrapper` may record what the
    other methods need (here the device type).

    ```python
    from hf_parallel import BalancedDataParallel
    from hf_parallel.transport import CudaTransport

    model = BalancedDataParallel(model.cuda(), gpu0_bsz=8, transport=CudaTransport())  # the default
    ```
    """

    device_type = "cuda"

    def init_wrapper(
        self, wrapper: nn.DataParallel, module: nn.Module, device_ids: Any, output_device: Any, dim: int
    ) -> None:
        """
        Initialise `wrapper`, an `nn.DataParallel` whose `__init__` has not run, over `device_ids`: set its `module`,
        `device_ids`, `output_device`, `dim` and `src_device_obj` as `nn.DataParallel.__init__` does (which, without
        accelerators, leaves `device_ids` empty: the wrapper then runs the module as it is).
        """
        nn.DataParallel.__init__(wrapper, module, device_ids, output_device, dim)
        if wrapper.device_ids:
            self.device_type = wrapper.src_device_obj.type

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int], dim: int
    ) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        """`nn.DataParallel`'s split of a call: `tensor.chunk` semantics, one call per chunk."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=dim)

    def split(self, tensor: torch.Tensor, device_ids: Sequence[int], chunk_sizes: Sequence[int], dim: int):
        """`tensor` split along `dim` into `chunk_sizes` rows, chunk `i` on `device_ids[i]`."""
        return Scatter.apply(list(device_ids), list(chunk_sizes), dim, tensor)

    def copy(self, tensor: torch.Tensor, device_ids: Sequence[int]) -> list[torch.Tensor]:
        """A copy of the 0-dim `tensor` on each of `device_ids`."""
        return [tensor.to(torch.device(self.device_type, d)) for d in device_ids]

    def replicate(self, module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:
        """One replica of `module` per device, whose gradients flow back to `module`'s parameters."""
        return replicate(module, device_ids, not torch.is_grad_enabled())

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any, device_ids: Sequence[int]
    ) -> list[Any]:
        """Replica `i` run on `inputs[i]` and `kwargs[i]`, on `device_ids[i]`, all at once."""
        return parallel_apply(replicas, inputs, kwargs, device_ids)

    def gather(self, outputs: Sequence[Any], output_device: Any, dim: int) -> Any:
        """The replicas' outputs joined along `dim` on `output_device` (0-dim tensors into a vector)."""
        return gather(outputs, output_device, dim=dim)


class TransportDataParallel(nn.DataParallel):
    """
    `nn.DataParallel` whose device work (setting up devices, split, replicate, apply, gather) is done by a
    transport. With the default `CudaTransport` it behaves exactly as `nn.DataParallel`.

    Subclasses may name another default in `transport_class`. Code that builds a wrapper for whatever
    `torch.nn.DataParallel` is at call time (as the Trainer does) uses that class's transport when it is a
    `TransportDataParallel`, so that a stand-in for `nn.DataParallel` carries its own device work along.

    Args:
        module (`nn.Module`):
            The model.
        device_ids (`list[int]`, *optional*):
            Devices, the first one holding the model (defaults to all).
        output_device (`int`, *optional*):
            Where outputs are gathered (defaults to `device_ids[0]`).
        dim (`int`, *optional*, defaults to `0`):
            Batch dimension of the inputs.
        transport (`CudaTransport` or an object with its methods, *optional*):
            The device work; defaults to a new `transport_class()`. One transport per wrapper.

    ```python
    from hf_parallel.transport import TransportDataParallel

    model = TransportDataParallel(model.cuda())  # nn.DataParallel(model.cuda()), step for step
    ```
    """

    transport_class: type = CudaTransport

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int] | None = None,
        output_device: int | None = None,
        dim: int = 0,
        *,
        transport: Any = None,
    ):
        transport = self.transport_class() if transport is None else transport
        transport.init_wrapper(self, module, device_ids, output_device, dim)
        self.transport = transport

    # nn.DataParallel.forward calls these four; each hands its work to the transport.
    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int]) -> Any:
        return self.transport.scatter(inputs, kwargs, device_ids, self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:
        return self.transport.replicate(module, device_ids)

    def parallel_apply(
        self,
        replicas: Sequence[nn.Module],
        inputs: Sequence[Any],
        kwargs: Any,
        device_ids: Sequence[int] | None = None,
    ) -> list[Any]:
        # nn.DataParallel runs replica i on device_ids[i]; a wrapper that skips devices passes the ids it uses.
        if device_ids is None:
            device_ids = self.device_ids[: len(replicas)]
        return self.transport.parallel_apply(replicas, inputs, kwargs, device_ids)

    def gather(self, outputs: Sequence[Any], output_device: Any) -> Any:
        return self.transport.gather(outputs, output_device, self.dim)


class _GradientsToSource(torch.autograd.Function):
    """
    Identity on the replicas' copies of parameters (made without autograd), whose backward sends their gradients to
    the parameters themselves: the sum over replicas of each one, moved to its device. Unlike torch's `Broadcast`,
    it asks for no gradient of a device that holds no replica.
    """

    @staticmethod
    def forward(ctx, num_params: int, *tensors: torch.Tensor):
        ctx.num_params = num_params
        ctx.devices = [t.device for t in tensors[:num_params]]
        ctx.set_materialize_grads(False)  # a replica that did not use a parameter sends nothing
        return tuple(tensors[num_params:])  # returned as views, so that they carry this node

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        num_params = ctx.num_params
        sums: list[torch.Tensor | None] = [None] * num_params
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            index = i % num_params
            grad = grad.to(ctx.devices[index])
            sums[index] = grad if sums[index] is None else sums[index] + grad
        return (None, *sums, *([None] * len(grads)))


def route_gradients_to(module: nn.Module, replicas: Sequence[nn.Module]) -> list[nn.Module]:
    """
    Make `replicas` of `module`, replicated without autograd (`torch.no_grad()`), send their parameters' gradients
    back to `module`'s parameters (summed), and return them. A replica that *is* `module` (a transport that runs every
    chunk on the module itself) is left as it is.

    The replicas' parameters that require gradients are replaced, in every submodule, by views of them that carry
    the routing; the others (frozen parameters) and the buffers stay the detached copies.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    copies_of = [r for r in replicas if r is not module]
    if not params or not copies_of:
        return list(replicas)
    index = {p: i for i, p in enumerate(params)}
    slots = []  # (replica submodule, attribute, parameter index), in replica order
    for replica in copies_of:
        for own, copy in zip(module.modules(), replica.modules(), strict=True):
            for key, param in own._parameters.items():
                if param is not None and param in index:
                    slots.append((copy, key, index[param]))
    routed = _GradientsToSource.apply(len(params), *params, *(getattr(copy, key) for copy, key, _ in slots))
    for (copy, key, _), tensor in zip(slots, routed, strict=True):
        copy._parameters.pop(key, None)  # a replica holds plain tensors, not nn.Parameters (torch's replicas too)
        setattr(copy, key, tensor)
    return list(replicas)
