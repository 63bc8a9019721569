"""
Replicas of a module for `nn.DataParallel` whose gradients reach the module as one device's would.

torch's `replicate` copies the parameters with the autograd function `Broadcast`, whose backward hands every
parameter a gradient from every replica, materialising **zeros** for a replica that did not use it: a parameter no
row used (an MoE expert no token was routed to, an unused head) gets a zero gradient instead of `None`, so AdamW
decays and moves it where one device would leave it alone. Its replicas also have no parameters
(`_replicate_for_data_parallel` empties `_parameters`; the copies are plain attributes), so transformers'
`model.device` / `model.dtype`, which read `next(model.parameters())`, raise `StopIteration` in a replica.

`replicate_with_routing` replicates without autograd and makes each replica's copy of a parameter a view carrying one
autograd node, `_GradientsToSource`, whose backward sums the gradients of the replicas that used the parameter (and
gives `None` when none did). A tied parameter (one tensor held by two modules, e.g. GPT-2's embedding and LM head) is
one copy per replica, shared by every module that holds it, as torch's replicas share it. The copies are kept in the
replicas' `_parameters`, so `model.device` and `model.dtype` work inside a replica.

transformers 5 records hidden states and attentions with forward hooks it installs at a model's first forward. A
replica shares its module's hook dictionaries (torch copies a module's `__dict__` shallowly), so a model whose first
forward runs in the replicas gets its hooks installed once per replica thread, into the same dictionaries: every
hidden state is then recorded several times (Segformer and LLaVA, whose forwards read them, fail or read the wrong
layers). `replicate_with_routing` installs them on the module first (`install_output_hooks`), once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import replicate

__all__ = ["install_output_hooks", "replicate_with_routing"]


def install_output_hooks(module: nn.Module) -> None:
    """
    Install transformers' output-recording hooks on the outermost transformers models inside `module` (each installs
    those of the models within it), unless a forward installed them already; nothing on releases without them. Each
    model is looked at once (it is then marked), so a replication walks only the wrappers above the models.
    """
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # transformers 4 returns hidden states without hooks
        return

    def outermost(node: nn.Module) -> None:
        if not isinstance(node, PreTrainedModel):
            for child in node.children():
                outermost(child)
            return
        if getattr(node, "_hf_parallel_output_hooks", False):
            return
        # Installed by a forward already (on the models it decorates): installing from the top would add each twice.
        if not any(getattr(m, "_output_capturing_hooks_installed", False) for m in node.modules()):
            maybe_install_capturing_hooks(node)
        node._hf_parallel_output_hooks = True

    outermost(module)


class _GradientsToSource(torch.autograd.Function):
    """
    Identity on the replicas' copies of parameters (made without autograd): `forward(num_params, *params, *copies)`
    with the copies ordered replica by replica, `num_params` each. Its backward gives each parameter the sum of its
    copies' gradients, on the parameter's device; `None` when no copy got one.
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
            index = i % num_params  # the copies are ordered replica by replica, one per parameter
            grad = grad.to(ctx.devices[index], non_blocking=True)
            sums[index] = grad if sums[index] is None else sums[index] + grad
        return (None, *sums, *([None] * len(grads)))


def _slots(module: nn.Module, replica: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Every (replica submodule, name, the module's parameter) a replica holds a parameter copy in."""
    slots = []
    for own, copy in zip(module.modules(), replica.modules(), strict=True):
        for key, param in own._parameters.items():
            if param is not None:
                slots.append((copy, key, param))
    return slots


def replicate_with_routing(module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:
    """
    `torch.nn.parallel.replicate(module, device_ids)`, except that a parameter a replica does not use gets no
    gradient from it (`None` overall when no replica uses it, as on one device) and that the replicas' parameters are
    visible to `replica.parameters()` (so `model.device` / `model.dtype` work in a replica). Without gradients
    (`torch.no_grad()`), the replicas hold torch's detached copies.

    ```python
    from hf_parallel.data_parallel.replication import replicate_with_routing

    class RoutedDataParallel(torch.nn.DataParallel):
        def replicate(self, module, device_ids):
            return replicate_with_routing(module, device_ids)
    ```
    """
    install_output_hooks(module)
    params = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    with torch.no_grad():
        replicas = replicate(module, device_ids, detach=True)
    per_replica = [_slots(module, replica) for replica in replicas]
    # Per replica, its copy of each parameter of the module: torch's detached one, replaced below by the routed one.
    copies = [{param: getattr(copy, key) for copy, key, param in slots} for slots in per_replica]
    n = len(params)
    routed = _GradientsToSource.apply(n, *params, *(of[p] for of in copies for p in params)) if params else ()
    for j, (slots, of) in enumerate(zip(per_replica, copies, strict=True)):
        of.update(zip(params, routed[j * n : (j + 1) * n], strict=True))
        for copy, key, param in slots:
            # torch stores a replica's copies as plain attributes, which `parameters()` does not see; keep them where
            # Module attribute lookup still finds them and `parameters()` lists them.
            copy.__dict__.pop(key, None)
            copy._parameters[key] = of[param]
    return replicas
