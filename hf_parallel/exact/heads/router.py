"""
The load-balancing auxiliary loss of a mixture-of-experts LM (`output_router_logits=True`: Mixtral, Qwen2/3-MoE,
OLMoE, GPT-OSS, ...), over the whole batch of every device.

transformers' `load_balancing_loss_func` concatenates the router logits of every MoE layer, takes each token's routing
probabilities (a softmax) and its top-k experts, and returns `E * sum_e f_e * P_e`: `f_e` the fraction of (layer,
token) pairs routed to expert e (counting each of the k choices), `P_e` their mean probability of e, both over the
tokens the attention mask keeps. The model adds `router_aux_loss_coef` times it to its cross-entropy. It is not a sum
over items: split the batch, and each part gets another `f` and `P`. But both are sums divided by one count, so with

    T_e = sum of top-k assignments to e,  Q_e = sum of the probabilities of e,  n = (layer, token) pairs kept

the loss of the whole batch is `E * sum_e T_e * Q_e / n^2`, where only Q carries a gradient. Each forward (a
DataParallel replica, a DDP rank) gives its `[T, Q, n]` per row (`RouterBalance.row_stats`); the step adds T and n over
replicas and ranks (one `[E + 1]` all-reduce, without gradient) and each rank back-propagates `E * T_all . Q_own /
n_all^2`: the ranks' terms add up to the loss of the whole batch, and their gradients to its gradient.

Under gradient accumulation the micro-batches run one after another, so no micro-batch's term can see the routing of
the next. With `router_balance="step"` (the default) the step first runs each micro-batch forward without gradient
and adds up T and n over the whole step (`step_stats`, over every rank too); each micro-batch then back-propagates
`E * T_step . Q_own / n_step^2`, and the step's terms add up to the loss of one forward over the whole step (the
"global-batch" balance), at the cost of one more forward without gradient per micro-batch. With "micro_batch" each
micro-batch gets its own global batch's term and the step takes their mean, with one warning (stock adds them up:
x the accumulation steps).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from .base import HeadMismatch

__all__ = ["ROUTER_BALANCES", "RouterBalance", "router_balance_of", "text_config"]

#: The values of `TrainingArguments.router_balance`: "step", the router term of one forward over the whole optimizer
#: step under gradient accumulation (exact; one more forward without gradient per micro-batch); "micro_batch", each
#: micro-batch's own term, averaged over the step (warned).
ROUTER_BALANCES = ("step", "micro_batch")


class RouterBalance:
    """
    The router auxiliary loss of a MoE model: `coef * E * sum_e T_e * Q_e / n^2` (see the module docstring).

    Args:
        experts (`int`): E, the experts per MoE layer.
        top_k (`int`): the experts each token is routed to.
        coef (`float`): the model's `router_aux_loss_coef`.
    """

    def __init__(self, experts: int, top_k: int, coef: float):
        if experts < 1 or not 1 <= top_k <= experts:
            raise ValueError(f"A router needs 1 <= top_k <= experts; got experts={experts}, top_k={top_k}.")
        self.experts, self.top_k, self.coef = int(experts), int(top_k), float(coef)

    def __repr__(self) -> str:
        return f"RouterBalance(experts={self.experts}, top_k={self.top_k}, coef={self.coef})"

    def row_stats(self, outputs, attention_mask: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """
        `[rows, 2E + 1]`: per row, T (top-k assignments per expert), Q (routing probability per expert, with its
        gradient) and n (its kept (layer, token) pairs), as the model's own loss function counts them; None when the
        outputs hold no router logits.
        """
        gates = outputs.get("router_logits") if isinstance(outputs, dict) else None
        if not gates:
            return None
        if torch.is_tensor(gates):
            gates = (gates,)
        device = gates[0].device
        assignments = torch.zeros(rows, self.experts, device=device)
        probabilities = torch.zeros(rows, self.experts, device=device)
        kept = torch.zeros(rows, device=device)
        for gate in gates:
            gate = gate.to(device).reshape(-1, gate.shape[-1])
            if gate.shape[-1] != self.experts or gate.shape[0] % rows:
                raise HeadMismatch(
                    f"router logits of shape {tuple(gate.shape)} do not give {self.experts} experts for each token "
                    f"of {rows} rows."
                )
            weights = torch.softmax(gate, dim=-1)  # in the gate's dtype, as the model's loss function takes them
            chosen = torch.topk(weights, self.top_k, dim=-1).indices
            tokens = gate.shape[0] // rows
            if attention_mask is None:
                mask = torch.ones(gate.shape[0], device=device)
            else:
                mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
                if mask.numel() != gate.shape[0]:
                    raise HeadMismatch(
                        f"the attention mask has {mask.numel()} positions but the router scored {gate.shape[0]}."
                    )
            hits = torch.zeros(gate.shape[0], self.experts, device=device).scatter_add_(
                1, chosen, mask.unsqueeze(-1).expand(-1, self.top_k).contiguous()
            )
            assignments = assignments + hits.view(rows, tokens, -1).sum(1)
            probabilities = probabilities + (weights.float() * mask.unsqueeze(-1)).view(rows, tokens, -1).sum(1)
            kept = kept + mask.view(rows, tokens).sum(1)
        return torch.cat([assignments.detach(), probabilities, kept.detach().unsqueeze(-1)], dim=-1)

    def split(self, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """T, Q and n of summed `[2E + 1]` stats."""
        experts = self.experts
        return stats[..., :experts], stats[..., experts : 2 * experts], stats[..., 2 * experts]

    def loss(self, own: torch.Tensor, everyone: torch.Tensor | None = None) -> torch.Tensor:
        """
        `coef` times the auxiliary loss, with the gradient of this forward's Q: `own` the `[2E + 1]` stats summed over
        this forward's rows, `everyone` the `[E + 1]` T and n of the whole batch (every replica and rank; `own`'s
        when None). 0 when no token was kept.
        """
        assignments, probabilities, kept = self.split(own)
        if everyone is not None:
            assignments, kept = everyone[: self.experts], everyone[self.experts]
        assignments, kept = assignments.to(probabilities.device, probabilities.dtype), kept.to(probabilities.device)
        scale = self.coef * self.experts / kept.to(probabilities.dtype).clamp(min=1).pow(2)
        return (assignments * probabilities).sum() * scale

    def forward_stats(self, stats: torch.Tensor | None, real: int | None = None) -> torch.Tensor | None:
        """`[1, 2E + 1]`: a forward's `[rows, 2E + 1]` statistics (`row_stats`) added up, the rows from `real` on (an
        epoch's padding) left out, in training and evaluation alike; None without them (no router logits)."""
        if stats is None:
            return None
        if real is not None:
            stats = stats.where((torch.arange(len(stats), device=stats.device) < real).reshape(-1, 1), 0)
        return stats.sum(0, keepdim=True)

    @contextlib.contextmanager
    def first_forward(self, model):
        """
        Around a Trainer subclass's loss (its own router term held back, see `hf_parallel.exact.heads.trainers`):
        yields a list that receives the `[rows, 2E + 1]` statistics of the first forward of `model`'s backbone (the
        policy's; a reference forward follows it).
        """
        found: list[torch.Tensor] = []

        def record(module, args, kwargs, outputs):
            if not found:
                rows = next(v for v in (*args, *kwargs.values()) if torch.is_tensor(v)).shape[0]
                stats = self.row_stats(outputs, kwargs.get("attention_mask"), rows)
                if stats is not None:
                    found.append(stats)

        handle = model.base_model.register_forward_hook(record, with_kwargs=True)
        try:
            yield found
        finally:
            handle.remove()

    def step_stats(self, forward, batches: list[dict], label_keys, real_rows) -> torch.Tensor:
        """
        `[E + 1]`: T and n of every micro-batch of a step (this rank's), from a forward of each without gradient, in
        float64. `forward` runs one micro-batch (the model, its DDP / DeepSpeed wrapper); label keys are left out of
        its inputs, and an LM asked for the last position's logits only, where its forward takes `logits_to_keep`.
        `real_rows`, per batch: how many of its leading rows are real (an epoch's padding after them), or None.
        """
        parameters = inspect.signature(getattr(forward, "forward", forward)).parameters
        extra = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        total = torch.zeros(self.experts + 1, dtype=torch.float64)
        left_out = {*label_keys, "shift_labels"}
        for batch, real in zip(batches, real_rows, strict=True):
            inputs = {key: value for key, value in batch.items() if key not in left_out}
            with torch.no_grad():
                outputs = forward(**inputs, **extra)
            rows = next(value for value in batch.values() if torch.is_tensor(value)).shape[0]
            stats = self.row_stats(outputs, inputs.get("attention_mask"), rows)
            if stats is None:
                raise HeadMismatch("the model returned no router logits in the step's first pass.")
            stats = stats[:real] if real is not None else stats
            total = total + self.shared(stats.sum(0)).cpu()
        return total

    def shared(self, own: torch.Tensor) -> torch.Tensor:
        """`[E + 1]`: what the devices add up (T and n, without gradient), in float64."""
        assignments, _, kept = self.split(own.detach())
        return torch.cat([assignments, kept.reshape(1)]).double()


def text_config(config):
    """The config of a model's text part (`get_text_config`), the config itself where it has none or several."""
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):  # no such method; several text configs (an encoder's and a decoder's)
        return config


def router_balance_of(model, asked: bool = False) -> RouterBalance | None:
    """
    The `RouterBalance` of a transformers MoE model that returns its router logits (`output_router_logits=True` in
    its config or its text config, or `asked` for them in its forward), from the attributes its forward reads
    (`num_experts`, `num_experts_per_tok`, `router_aux_loss_coef`, else its text config's); None for a model without
    them.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = text_config(config)
    if not (asked or getattr(config, "output_router_logits", False) or getattr(text, "output_router_logits", False)):
        return None

    def read(*names: str):
        for source in (model, text, config):
            for name in names:
                value = getattr(source, name, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return value
        return None

    experts = read("num_experts", "num_local_experts")
    top_k = read("num_experts_per_tok")
    coef = read("router_aux_loss_coef")
    if experts is None or top_k is None or coef is None:
        return None
    return RouterBalance(int(experts), int(top_k), float(coef))
