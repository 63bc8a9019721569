"""
Trainer subclasses that compute their own loss (TRL's SFT, DPO, reward and KTO trainers) as head families. The
subclass's `compute_loss` stays the micro-batch's loss, with its fused LM head, its loss types and its metrics; the
head says what an item of the step is and how that loss makes the micro-batch's sum S (`Route.TRAINER_LOSS`). The
step then divides by the whole step's items, as for every head:

| trainer | an item | its loss, given `num_items_in_batch` = n | S |
|---|---|---|---|
| `SFTTrainer` (`nll`, `dft`) | a label token after the causal shift | S / n, times TRL's DDP factor f | loss x n / f |
| `DPOTrainer`, `RewardTrainer` | a preference pair (a chosen, a rejected row) | its pairs' mean | loss x pairs |
| `DPOTrainer` with `sft` | a pair, and a chosen token (`PairsAndSftHead`) | pairs' mean, sft scaled | loss x pairs |
| `KTOTrainer` | a row, given the step's KL reference point (`KtoHead`) | its rows' mean | loss x rows |
| `GRPOTrainer`, `RLOOTrainer` | a completion, or its token (`GenerationHead`) | its items' mean | loss x items |

A trainer whose loss is none of these keeps its own loss, warned naming why: distillation (its own normalisation),
DPO's `sft` term weighted by the pairs' weights, GRPO with a term or a mask made per micro-batch. The trainer is
known by the class that defines `compute_loss` (TRL's own, not a user's override of it). TRL's logged metrics that
are means over these items are made the whole step's too (`LoggedMetrics`).
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable

import torch

from .base import LossHead, Route
from .contrastive import rows_of
from .router import RouterBalance, router_balance_of
from .tokens import CrossEntropyHead

__all__ = [
    "GenerationHead",
    "KtoHead",
    "LoggedMetrics",
    "PairsAndSftHead",
    "SampleMeanHead",
    "TokenSumHead",
    "TrainerLossHooks",
    "trainer_loss_head",
]


class TrainerLossHooks:
    """
    What the head of a Trainer subclass's own loss adds to the one step around that loss, each a hook the Trainer
    calls whatever the family (here: nothing; KTO's reference point, DPO's sft weight, GRPO's generations override
    them). `logged` makes TRL's logged metrics the whole step's, where set.
    """

    route = Route.TRAINER_LOSS
    #: TRL's logged metrics made the whole step's (`LoggedMetrics`), or None to keep TRL's.
    logged: LoggedMetrics | None = None

    def sums(self, loss: torch.Tensor, given: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """S of a micro-batch of `items` items from the subclass's loss (given `given` as its `num_items_in_batch`),
        where that loss is the mean over the micro-batch's items."""
        return loss.float() * items

    def before_count(self, trainer, batches: list) -> list:
        """The step's micro-batches as they will be computed, before they are counted (GRPO's generations)."""
        return batches

    def step_shared(self, trainer, counts: torch.Tensor, batches: list[dict], add: Callable) -> torch.Tensor | None:
        """What every micro-batch's loss takes of the whole step (`StepCounts.shared`): its `counts` (added over
        ranks), its real `batches`; `add` sums a tensor over the ranks. None: nothing."""
        return None

    def evaluation_shared(self, trainer, dataloader, gather: Callable) -> torch.Tensor | None:
        """What every evaluation batch's loss takes of the whole set, made first (`gather`: accelerate's
        `gather_for_metrics`). None: nothing."""
        return None

    def evaluation_remainder(self, loader, remainder: int) -> int:
        """The real rows of the last global batch of an evaluation `loader`: accelerate's count, `remainder`."""
        return remainder

    def loss_call(self, trainer, inputs: dict, items: torch.Tensor, shared, training: bool) -> tuple[dict, dict]:
        """How the subclass's `compute_loss` is called on a micro-batch of `items` (the head's count), given what the
        step (the set) `shared`: the inputs to give it, and the trainer's attributes (methods too) set around it."""
        return inputs, {}

    def router_forward(self, model) -> Callable:
        """For a MoE router's statistics of the whole step (`router_balance="step"`): a forward of `model`'s backbone,
        which holds the router, given the inputs it takes of a batch that carries keys of the subclass's own."""
        backbone = model.base_model
        accepted = inspect.signature(backbone.forward).parameters

        def forward(**inputs):
            taken = {key: value for key, value in inputs.items() if key in accepted}
            return backbone(**taken, output_router_logits=True)

        return forward


class TokenSumHead(TrainerLossHooks, CrossEntropyHead):
    """
    SFT's loss: the sum of its per-token losses (negative log-likelihood, or DFT's weighted one) over the label tokens
    after the causal shift, divided by the `num_items_in_batch` it is given and multiplied by `factor` (TRL's, under
    DDP with `average_tokens_across_devices`).
    """

    def __init__(self, name: str, factor: int):
        super().__init__(("labels",), name, shift=True, per_position=True, shift_ambiguous=False)
        self.factor = factor

    def sums(self, loss: torch.Tensor, given: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """S of a micro-batch from the subclass's loss, given `given` as its `num_items_in_batch`."""
        return loss.float() * given.to(loss.device) / self.factor


class SampleMeanHead(TrainerLossHooks, LossHead):
    """
    A loss that is the mean over a batch's samples of a per-sample loss: DPO's loss types and their weighted sums and
    the reward model's Bradley-Terry loss with its margin and centring term, over preference pairs (a batch holds each
    pair as two rows, the chosen ones first: `[chosen; rejected]`, `rows_per_sample` 2); KTO's, over rows.
    """

    def __init__(self, name: str, rows_per_sample: int = 2):
        super().__init__(label_keys=(), name=name)
        self.rows_per_sample = rows_per_sample

    def count(self, batch: dict, seq_len: int | None = None) -> torch.Tensor:
        """The samples of a batch (cut to its real ones by the step, where an epoch's end padded it)."""
        return torch.tensor([rows_of(batch) // self.rows_per_sample])


class PairsAndSftHead(SampleMeanHead):
    """
    DPO with its `sft` term: its other loss types a mean over pairs, `sft` the mean negative log-likelihood over the
    chosen completions' tokens. Two counts, the pairs and the chosen tokens; TRL's `sft` weight of each micro-batch is
    scaled (`loss_call`) so that, times its pairs over the step's, its term is its chosen tokens' share of the
    step's. The step's counts in training; in evaluation the whole set's, counted first (`evaluation_shared`).
    """

    weights = (1.0, 1.0)

    def __init__(self, sft: int):
        super().__init__("trl_dpo_sft")
        self.sft = sft  # the place of "sft" in TRL's `loss_type` list

    def count(self, batch: dict, seq_len: int | None = None) -> torch.Tensor:
        """The real pairs of a batch (`[chosen; rejected]` rows) and their chosen completions' tokens after the
        causal shift (TRL's mask of the `sft` term)."""
        pairs = super().count(batch)
        chosen = batch["completion_mask"][: int(pairs), 1:]
        return torch.cat([pairs, chosen.sum().reshape(1).cpu()])

    def sums(self, loss: torch.Tensor, given: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """S of a micro-batch from TRL's loss with its `sft` weight scaled: all of it over pairs."""
        return torch.stack([loss.float() * items[0], loss.new_zeros((), dtype=torch.float32)])

    def step_shared(self, trainer, counts: torch.Tensor, batches: list[dict], add: Callable) -> torch.Tensor:
        """The step's pairs and chosen tokens."""
        return counts

    def evaluation_shared(self, trainer, dataloader, gather: Callable) -> torch.Tensor:
        """The pairs and chosen tokens of the whole evaluation set."""
        chosen = (gather(batch["completion_mask"][: rows_of(batch) // 2, 1:].sum(1)) for batch in dataloader)
        return _sum_and_rows(chosen).flip(0)  # [pairs, chosen tokens], as `count`

    def loss_call(self, trainer, inputs: dict, items: torch.Tensor, shared, training: bool) -> tuple[dict, dict]:
        """TRL's `loss_weights` for a micro-batch: the `sft` weight times (chosen tokens / pairs) of the micro-batch
        (`items`) times (pairs / chosen tokens) of the step or set (`shared`)."""
        pairs, tokens = (float(n) for n in items)
        all_pairs, all_tokens = (float(n) for n in shared)
        weights = list(trainer.loss_weights)
        weights[self.sft] *= tokens * all_pairs / (pairs * all_tokens) if pairs and all_tokens else 0.0
        return inputs, {"loss_weights": weights}


class KtoHead(SampleMeanHead):
    """
    KTO's loss: a weighted mean over rows, each a desirable or an undesirable completion, measured against a KL
    reference point, the mean over rows of the policy's minus the reference model's log-probability of a mismatched
    completion (TRL pairs each prompt with another row's). TRL estimates the point on each micro-batch (and averages
    ranks' means); here it is made once over the whole step's rows, or the whole evaluation set's, by a forward without
    gradient (`step_shared`, `evaluation_shared`), and each micro-batch's loss is given it in place of its own forwards
    of those rows (`loss_call`): the same forwards, once.
    """

    def __init__(self, owner: type):
        super().__init__("trl_kto", rows_per_sample=1)
        # TRL's helpers of its KL forwards (adapters, checkpointing), called as its loss calls them
        self.trl_module = owner.__module__

    def differences(self, trainer, batch: dict) -> torch.Tensor:
        """Per row of `batch`, the policy's minus the reference model's log-probability of its KL completion."""
        with torch.no_grad(), trainer.compute_loss_context_manager():
            batch = trainer._prepare_inputs(batch)
            policy = trainer._compute_kl_logps(trainer.model, batch)
            if trainer.precompute_ref_logps:
                return policy - batch["ref_KL_logps"]
            trl = sys.modules[self.trl_module]
            with trl.disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
                if trl.is_peft_model(trainer.model) and trainer.ref_model is None:
                    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
                    adapter = "ref" if "ref" in unwrapped.peft_config else None
                    with trl.use_adapter(unwrapped, adapter_name=adapter):
                        return policy - trainer._compute_kl_logps(trainer.model, batch)
                return policy - trainer._compute_kl_logps(trainer.ref_model, batch)

    def step_shared(self, trainer, counts: torch.Tensor, batches: list[dict], add: Callable) -> torch.Tensor | None:
        """
        The point of a training step: the mean of `differences` over `batches` (cut to their real rows), their sum and
        rows added over ranks by `add`; None where TRL computes no KL term (`calculate_KL`).
        """
        if not trainer.calculate_KL:
            return None
        return _mean(add(_sum_and_rows(self.differences(trainer, batch) for batch in batches).to(trainer.args.device)))

    def evaluation_shared(self, trainer, dataloader, gather: Callable) -> torch.Tensor | None:
        """The point of an evaluation: the mean of `differences` over the whole set, each batch's rows of every rank
        gathered by `gather`; None where TRL computes no KL term."""
        if not trainer.calculate_KL:
            return None
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            return _mean(_sum_and_rows(gather(self.differences(trainer, batch)) for batch in dataloader))
        finally:
            trainer.model.train(was_training)

    def loss_call(self, trainer, inputs: dict, items: torch.Tensor, shared, training: bool) -> tuple[dict, dict]:
        """
        TRL's loss takes `shared`, the step's (the set's) point, as its KL reference point: of the two forwards
        of a batch's KL rows it makes (the policy's, then the reference model's), the first returns the point (plus a
        precomputed reference value, which TRL then subtracts) and the second 0.
        """
        if shared is None:
            return inputs, {}
        calls = []

        def given(model, batch):
            rows = batch["KL_input_ids"].shape[0]
            calls.append(model)
            if len(calls) > 1:
                return torch.zeros(rows, device=shared.device)
            value = shared.to(batch["KL_input_ids"].device).expand(rows)
            return value + batch["ref_KL_logps"] if trainer.precompute_ref_logps else value

        return inputs, {"_compute_kl_logps": given}


class GenerationHead(TrainerLossHooks, LossHead):
    """
    The loss of a trainer that generates its completions (GRPO's, RLOO's): a mean over the completions of a batch
    (`items="rows"`: GRPO's `grpo`, `sapo` and `luspo`, RLOO's), over their tokens (`"tokens"`: `bnpo`, and `dapo`,
    `cispo`, `vespo`, whose count TRL takes of the generation batch, not of the step), or a sum over tokens divided by
    the completions times `max_completion_length` (`"padded"`: `dr_grpo`).

    The completions exist only once TRL's `_prepare_inputs` made them (every `steps_per_generation` micro-batches, for
    a whole generation batch), so the step's micro-batches are prepared before it is counted (`prepare`), at the
    weights stock generates them at (`before_count`); each micro-batch's loss is then TRL's over its own items
    (`loss_call`), its S that mean times its items.
    """

    def __init__(
        self, name: str, items: str, length: int | None = None, share: int | None = None, repeats: int = 1
    ) -> None:
        super().__init__(label_keys=(), name=name)
        self.items = items
        # TRL's evaluation sampler repeats each prompt `repeats` times (`num_generations_eval`)
        self.repeats = repeats
        self.length = length  # max_completion_length, for "padded"
        # dapo's kind: TRL divides by `num_items_in_batch` (the generation batch's tokens, all ranks) over the ranks
        # and `share` micro-batches (`steps_per_generation`)
        self.share = share

    def count(self, batch: dict, seq_len: int | None = None) -> torch.Tensor:
        """
        A prepared batch's completions, their tokens (those TRL's loss masks in), or completions x the length (of the
        last evaluation batch under DDP, the step cut it to its real rows first: accelerate's repeats left out).
        """
        mask = batch["completion_mask"]
        rows = mask.shape[0]
        if self.items == "rows":
            return torch.tensor([rows])
        if self.items == "padded":
            return torch.tensor([rows * self.length])
        if "tool_mask" in batch:
            mask = mask * batch["tool_mask"][: mask.shape[0]]
        return mask.sum().reshape(1).cpu()

    def before_count(self, trainer, batches: list) -> list[dict]:
        """
        TRL's micro-batches of a training step from the dataloader's (generation batches): `_prepare_inputs` of each,
        with the trainer's micro-batch counter `_step` as each will have it, the model in training mode; the counter
        is left as it was (TRL's `training_step` advances it).
        """
        trainer.model_wrapped.train()
        start = trainer._step
        try:
            prepared = []
            for offset, batch in enumerate(batches):
                trainer._step = start + offset
                prepared.append(trainer._prepare_inputs(batch))
            return prepared
        finally:
            trainer._step = start

    def evaluation_remainder(self, loader, remainder: int) -> int:
        """
        The real rows of the last global batch of an evaluation `loader` (accelerate's): accelerate counts the set's
        prompts (the dataset's length, `remainder`), where TRL's sampler gives each prompt `repeats` times.
        """
        return len(loader.dataset) * self.repeats % loader.total_batch_size

    def loss_call(self, trainer, inputs: dict, items: torch.Tensor, shared, training: bool) -> tuple[dict, dict]:
        """
        TRL's loss is the mean over the batch's own items: not divided by the accumulation steps (GRPO divides
        by them itself in training); for dapo's kind, `num_items_in_batch` made the batch's own tokens times the ranks
        (and, in training, the micro-batches of a generation).
        """
        if self.share is not None:
            shares = trainer.accelerator.num_processes * (self.share if training else 1)
            count = self.count(inputs).to(inputs["completion_mask"].device) * shares
            inputs = {**inputs, "num_items_in_batch": count}
        return inputs, {"current_gradient_accumulation_steps": 1} if training else {}


class LoggedMetrics:
    """
    TRL's logged metrics over the whole step, or the whole evaluation: TRL appends to `trainer._metrics` one value per
    micro-batch (its mean over the micro-batch's items, gathered from every rank) and logs the mean of those values.
    Here each value is kept with its micro-batch's items (`record`), and what is logged is their item-weighted mean
    (`combine`), or the least or largest value for a minimum or maximum.

    Args:
        kinds (`dict[str, str]`): per metric, `"mean"`, `"min"` or `"max"`.
    """

    def __init__(self, kinds: dict[str, str]):
        self.kinds = kinds
        self.items: dict[str, dict[str, list[float]]] = {"train": {}, "eval": {}}

    def lengths(self, metrics: dict) -> dict[str, int]:
        """How many values each metric holds, before a micro-batch's loss."""
        return {key: len(metrics.get(key, ())) for key in self.kinds}

    def record(self, metrics: dict, before: dict[str, int], items: float, mode: str) -> None:
        """After a micro-batch's loss: each metric it appended one value to keeps the micro-batch's `items`."""
        for key, length in before.items():
            if len(metrics.get(key, ())) == length + 1:
                self.items[mode].setdefault(key, []).append(items)

    def combine(self, metrics: dict, mode: str, add: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """
        Before TRL logs `metrics` (its `_metrics[mode]`): each mean metric whose every value was recorded made one
        value, the items-weighted mean, the micro-batches' items added over ranks by `add` (one collective); a minimum
        or a maximum the least or largest value.
        """
        recorded, self.items[mode] = self.items[mode], {}
        means = [
            key for key, kind in self.kinds.items()
            if kind == "mean" and metrics.get(key) and len(recorded.get(key, ())) == len(metrics[key])
        ]  # fmt: skip
        if means:
            weights = add(torch.tensor([w for key in means for w in recorded[key]], dtype=torch.float64)).cpu()
            for key, part in zip(means, weights.split([len(metrics[key]) for key in means]), strict=True):
                if part.sum() > 0:
                    values = torch.tensor(metrics[key], dtype=torch.float64)
                    metrics[key] = [float((part * values).sum() / part.sum())]
        for key, kind in self.kinds.items():
            if kind != "mean" and metrics.get(key):
                metrics[key] = [min(metrics[key]) if kind == "min" else max(metrics[key])]


#: The metrics of TRL's trainers that are means over the head's items (SFT: label tokens; DPO and the reward model:
#: pairs), minima or maxima; TRL's others (DPO's token means over completions, GRPO's) stay TRL's.
_LOGGED = {
    "SFTTrainer": dict.fromkeys(("entropy", "mean_token_accuracy"), "mean"),
    "DPOTrainer": dict.fromkeys(
        ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
         "logps/rejected"),
        "mean",
    ),  # fmt: skip
    "RewardTrainer": {"accuracy": "mean", "margin": "mean", "mean_reward": "mean", "min_reward": "min",
                      "max_reward": "max"},
}  # fmt: skip


def _sum_and_rows(values) -> torch.Tensor:
    """`[sum, rows]` of per-row `values` (an iterable of vectors), in float64 on the CPU."""
    totals = torch.zeros(2, dtype=torch.float64)
    for value in values:
        value = value.double().cpu()
        totals += torch.stack([value.sum(), totals.new_tensor(len(value))])
    return totals


def _mean(totals: torch.Tensor) -> torch.Tensor:
    return (totals[0] / totals[1].clamp(min=1)).float()


def _loss_types(args) -> list[str]:
    loss_type = getattr(args, "loss_type", None)
    return list(loss_type) if isinstance(loss_type, (list, tuple)) else [loss_type]


def trainer_loss_head(
    owner: type, args, ranks: int, trainer=None, warn_once: Callable[[str], None] = warnings.warn
) -> LossHead | str | None:
    """
    The head of the loss `owner.compute_loss` computes (`owner` the class that defines it; `args` its arguments;
    `ranks` the data-parallel processes), why there is none where the trainer is known but its loss is not a sum over
    items (a sentence for the warning), or None for a class this module does not know. Given the `trainer`, a MoE
    model's router term, which TRL adds per micro-batch, is the head's `router`, made the whole step's (warned with
    `warn_once` where the model's config does not name its experts).
    """
    if not owner.__module__.startswith("trl."):
        return None
    head = _head(owner, args, ranks)
    if not isinstance(head, LossHead):
        return head
    if owner.__name__ in _LOGGED:
        head.logged = LoggedMetrics(_LOGGED[owner.__name__])
    if getattr(trainer, "aux_loss_enabled", False):
        if isinstance(head, GenerationHead):
            return "its MoE router term is a mean over each micro-batch's completions."
        router = router_balance_of(trainer.model, asked=True)
        if router is None:
            warn_once(
                f"exact_loss: {owner.__name__}'s loss is exact over the whole step, but the router auxiliary term it "
                f"adds is its own (a mean over each micro-batch): {type(trainer.model).__name__}'s config does not "
                "name its experts (num_experts, num_experts_per_tok)."
            )
        else:  # TRL's term (a mean over each micro-batch) held back, the whole step's added
            head.router = RouterBalance(router.experts, router.top_k, trainer.router_aux_loss_coef)
    return head


def _head(owner: type, args, ranks: int) -> LossHead | str | None:
    name = owner.__name__
    if name == "SFTTrainer":
        if _loss_types(args) not in (["nll"], ["dft"]):
            return f"its loss_type={args.loss_type!r} is not one of 'nll' and 'dft'."
        return TokenSumHead("trl_sft", ranks if args.average_tokens_across_devices else 1)
    if name == "DPOTrainer":
        types = _loss_types(args)
        if "sft" not in types:
            return SampleMeanHead("trl_dpo")
        if args.use_weighting:
            return "its 'sft' loss term, a mean over chosen tokens, is weighted by the mean of the pairs' weights."
        return PairsAndSftHead(types.index("sft"))
    if name == "RewardTrainer":
        return SampleMeanHead("trl_reward")
    if name == "KTOTrainer":
        return KtoHead(owner)
    if name == "GRPOTrainer":
        return _grpo_head(args)
    if name == "RLOOTrainer":
        return GenerationHead("trl_rloo", "rows", repeats=args.num_generations_eval or args.num_generations)
    if name == "DistillationTrainer":
        return "its loss is normalised by its own token counts."
    return None


def _grpo_head(args) -> GenerationHead | str:
    if args.top_entropy_quantile < 1.0:
        return "its entropy mask keeps the top quantile of each micro-batch's tokens (top_entropy_quantile < 1)."
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        return "its entropy bonus is a mean over each micro-batch's tokens (entropy_coef)."
    kind, repeats = args.loss_type, args.num_generations_eval or args.num_generations
    if kind in ("grpo", "sapo", "luspo"):
        return GenerationHead("trl_grpo", "rows", repeats=repeats)
    if kind == "bnpo":
        return GenerationHead("trl_grpo", "tokens", repeats=repeats)
    if kind == "dr_grpo":
        return GenerationHead("trl_grpo", "padded", length=args.max_completion_length, repeats=repeats)
    if kind in ("dapo", "cispo", "vespo"):
        return GenerationHead("trl_grpo", "tokens", share=args.steps_per_generation, repeats=repeats)
    return f"its loss_type={kind!r} is not one hf_parallel knows."
