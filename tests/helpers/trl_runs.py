"""
Every trainer TRL exports, built the way TRL's docs build them (a model, a config, a dataset of strings and a
tokenizer), on a tiny Llama and a word-level tokenizer made in code, for one optimizer step on the CPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any
from unittest import mock

import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
)

from tests.helpers.tiny import tiny

WORDS = ["good", "bad", "movie", "day", "food", "was", "very", "it", "this", "so", "fun", "dull", "calm", "sad"]
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>"]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with padding, beginning and end tokens (TRL's trainers read all three)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )


def _config(**overrides) -> LlamaConfig:
    return tiny(
        LlamaConfig, vocab_size=len(SPECIALS + WORDS), pad_token_id=0, bos_token_id=2, eos_token_id=3, **overrides
    )


def causal_lm(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config())


def moe_lm(seed: int = 0) -> MixtralForCausalLM:
    """A tiny Mixtral (4 experts, 2 a token) with a router term large enough to move an update (coefficient 0.5)."""
    torch.manual_seed(seed)
    config = tiny(
        MixtralConfig, vocab_size=len(SPECIALS + WORDS), pad_token_id=0, bos_token_id=2, eos_token_id=3,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def reward_model(seed: int = 0) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(_config(num_labels=1))


def _sentences(n: int, seed: int, low: int, high: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) for _ in range(n)]


def dataset_rows(kind: str, n: int) -> list[dict]:
    prompts, first, second = _sentences(n, 0, 2, 4), _sentences(n, 1, 1, 4), _sentences(n, 2, 1, 4)
    if kind == "language_modeling":
        return [{"text": f"{p} {c}"} for p, c in zip(prompts, first, strict=True)]
    if kind == "preference":
        return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(prompts, first, second, strict=True)]
    if kind == "implicit_preference":  # the reward trainer: the prompt inside each answer
        return [{"chosen": f"{p} {c}", "rejected": f"{p} {r}"} for p, c, r in zip(prompts, first, second, strict=True)]
    if kind == "unpaired_preference":
        return [
            {"prompt": p, "completion": c, "label": i % 2 == 0}
            for i, (p, c) in enumerate(zip(prompts, first, strict=True))
        ]
    if kind == "prompt_completion":
        return [{"prompt": p, "completion": c} for p, c in zip(prompts, first, strict=True)]
    if kind == "prompt_only":
        return [{"prompt": p} for p in prompts]
    raise ValueError(f"unknown dataset kind {kind!r}")


def fixed_completions(prompt_ids: list[list[int]]) -> list[list[int]]:
    """
    Completions of 1 to 4 words and an end token, each made of its prompt's tokens and its place among the prompt's
    consecutive repeats (TRL's samplers put a prompt's generations next to each other): the same rows under every split
    of a step whose batches hold whole groups, so that only the loss differs, and lengths that differ within a group
    (their rewards do) and between micro-batches (their token counts do).
    """
    completions, previous, repeat = [], None, 0
    for ids in prompt_ids:
        repeat = repeat + 1 if ids == previous else 0
        previous = ids
        words = 1 + (len(ids) + sum(ids) + repeat) % 4
        first = len(SPECIALS)
        completions.append([first + (7 * sum(ids) + 5 * repeat + 3 * j) % len(WORDS) for j in range(words)] + [3])
    return completions


def fixed_rollout(prompts: list[str], trainer) -> dict:
    """GRPO's `rollout_func`, its public hook for a generator of one's own: `fixed_completions`."""
    prompt_ids = [trainer.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return {"prompt_ids": prompt_ids, "completion_ids": fixed_completions(prompt_ids), "logprobs": None}


def word_count_reward(completions: list[str], **kwargs) -> list[float]:
    """A reward function of the kind TRL's docs show: longer completions score higher."""
    return [float(len(c.split())) for c in completions]


@dataclasses.dataclass(frozen=True)
class TrlCase:
    """One TRL trainer: its class and config names, the model it trains, its dataset, and what else it takes."""

    trainer: str
    config: str
    dataset: str
    model: Callable[[int], torch.nn.Module] = causal_lm
    extra: Callable[[], dict[str, Any]] = dict  # the trainer's own arguments besides model/args/dataset
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # the config's own fields


# Generation short and sampled from a fixed seed: two completions a prompt, four tokens each. RLOO's reference model
# (beta > 0) is loaded again from the policy's name, which a model built from a config does not have.
_GENERATES = {"num_generations": 2, "max_completion_length": 4, "per_device_train_batch_size": 2}

CASES = {
    case.trainer: case
    for case in (
        TrlCase("SFTTrainer", "SFTConfig", "language_modeling"),
        TrlCase("DPOTrainer", "DPOConfig", "preference", extra=lambda: {"ref_model": causal_lm(1)}),
        TrlCase("RewardTrainer", "RewardConfig", "implicit_preference", model=reward_model),
        TrlCase("KTOTrainer", "KTOConfig", "unpaired_preference", extra=lambda: {"ref_model": causal_lm(1)}),
        TrlCase(
            "GRPOTrainer",
            "GRPOConfig",
            "prompt_only",
            extra=lambda: {"reward_funcs": word_count_reward},
            settings=_GENERATES,
        ),  # fmt: skip
        TrlCase(
            "RLOOTrainer",
            "RLOOConfig",
            "prompt_only",
            extra=lambda: {"reward_funcs": word_count_reward},
            settings={**_GENERATES, "beta": 0.0},
        ),  # fmt: skip
        TrlCase(
            "DistillationTrainer",
            "DistillationConfig",
            "prompt_completion",
            extra=lambda: {"teacher_model": causal_lm(1)},
            settings={"max_completion_length": 4},
        ),  # fmt: skip
    )
}


def run_one_step(trl, case: TrlCase, trainer_cls: type, output_dir: str, rows: int = 4, positional: bool = False):
    """
    Train `trainer_cls` (a TRL trainer, or one with hf_parallel's mixin first) for one step; the trainer. With
    `positional`, the model, the arguments and whatever the trainer's signature puts between them (DPO's `ref_model`,
    GRPO's `reward_funcs`) are passed by position, in the TRL trainer's order.
    """
    import datasets

    config_cls = getattr(trl, case.config)
    settings = {"per_device_train_batch_size": rows, **case.settings}
    args = config_cls(
        output_dir=output_dir, max_steps=1, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, learning_rate=1e-2, **settings,
    )  # fmt: skip
    named = {"model": case.model(0), "args": args, **case.extra()}
    leading = []
    if positional:
        for name in list(inspect.signature(getattr(trl, case.trainer).__init__).parameters)[1:]:
            if name not in named:
                break
            leading.append(named.pop(name))
        assert not {"model", "args"} & named.keys(), f"{trainer_cls.__name__}: model and args are not leading"
    train_dataset = datasets.Dataset.from_list(dataset_rows(case.dataset, rows))
    trainer = trainer_cls(*leading, train_dataset=train_dataset, processing_class=tokenizer(), **named)
    trainer.train()
    return trainer


# ---- A TRL trainer on a split step and on the whole one (tests/test_trl_exact.py) ----

#: The trainers that generate their completions: two a prompt, up to 5 tokens, prompts in order; no clipping of the
#: gradient's norm (a loss off by a factor, dapo's, would leave a clipped update as it is).
_GENERATING = {"num_generations": 2, "max_completion_length": 5, "shuffle_dataset": False, "max_grad_norm": 0.0}
GENERATING = {"GRPOTrainer": _GENERATING, "RLOOTrainer": {**_GENERATING, "beta": 0.0}}


def _fixed_single_turn(self, prompt_ids, images, multimodal_fields):
    """RLOO's generator, replaced: `fixed_completions`."""
    return fixed_completions(prompt_ids)


#: One epoch, rows in order, plain SGD in fp32 (TRL's configs default to bf16), a loss logged every step: a split
#: step and the whole one then see the same rows, and their updates can be compared.
SPLIT_SETTINGS = {
    "num_train_epochs": 1, "max_steps": -1, "train_sampling_strategy": "sequential", "optim": "sgd",
    "learning_rate": 0.5, "bf16": False, "fp16": False, "lr_scheduler_type": "constant", "warmup_steps": 0,
}  # fmt: skip


def train_split(
    trl, name: str, trainer_cls: type, output_dir: str, *, rows: int, per_device: int, accumulation: int = 1,
    eval_batch: int | None = None, settings: dict | None = None, kl_pairs: int | None = None,
) -> dict:  # fmt: skip
    """
    `trainer_cls` (TRL's `name` trainer, or one with hf_parallel's mixin) for one epoch of `rows` rows, `per_device`
    rows a micro-batch and `accumulation` micro-batches a step: `eval_loss` at the initial weights (batches of
    `eval_batch` rows, when given), the logged loss of each step and the trained weights (rank 0's, on every rank).
    KTO pairs each prompt with another row's completion for its KL term, in chunks of the per-device batch as it
    prepares the dataset: `kl_pairs` prepares it in chunks of that size instead (a whole step then holds the split
    one's pairs).
    """
    import datasets

    case = CASES[name]
    config_cls = getattr(trl, case.config)
    settings = dict(settings or {})
    generating = name in GENERATING
    if generating:  # rows are prompts; per_device and eval_batch count completions (num_generations a prompt)
        settings = {**GENERATING[name], **settings}
    exact_loss = settings.pop("exact_loss", None)  # hf_parallel's field: set on the config TRL built
    margins = settings.pop("margins", False)  # the reward trainer's `margin` column, one value a pair
    model = moe_lm if settings.pop("moe", False) else case.model  # a MoE model in place of the trainer's own
    args = config_cls(
        output_dir=output_dir, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True,
        seed=0, per_device_train_batch_size=kl_pairs or per_device, gradient_accumulation_steps=accumulation,
        per_device_eval_batch_size=eval_batch or 1,
        **{**SPLIT_SETTINGS, **({} if generating else case.settings), **settings},
    )  # fmt: skip
    if exact_loss is not None:
        args.exact_loss = exact_loss
    data = dataset_rows(case.dataset, rows)
    data = datasets.Dataset.from_list([{**row, "margin": 0.3 * i} for i, row in enumerate(data)] if margins else data)
    extra = case.extra()
    if model is moe_lm and "ref_model" in extra:
        extra["ref_model"] = moe_lm(1)
    if name == "GRPOTrainer":
        extra["rollout_func"] = fixed_rollout
    if name == "RLOOTrainer":  # no rollout hook: its generator replaced in a subclass
        trainer_cls = type(trainer_cls.__name__, (trainer_cls,), {"_generate_single_turn": _fixed_single_turn})
    policy = model(0)
    if generating and args.beta:  # GRPO loads its reference model from the policy's path: another model saved there
        model(1).save_pretrained(f"{output_dir}/reference")
        policy.config.name_or_path = f"{output_dir}/reference"
    trainer = trainer_cls(
        model=policy, args=args, train_dataset=data, eval_dataset=data if eval_batch else None,
        processing_class=tokenizer(), **extra,
    )  # fmt: skip
    trainer.remove_callback(transformers.PrinterCallback)  # the logs are in state.log_history
    if kl_pairs:  # the dataset is prepared: train in micro-batches of `per_device`
        args.per_device_train_batch_size = per_device
        trainer._train_batch_size = args.train_batch_size
    # A generation batch's rows in order (TRL shuffles them before it deals them to micro-batches): a step split over
    # a generation batch of several steps holds the rows of the whole step's own generation batch.
    module = sys.modules[getattr(trl, name).__module__]
    in_order = mock.patch.object(module, "shuffle_sequence_dict", lambda rows: rows) if generating else nullcontext()
    with in_order:
        evaluated = trainer.evaluate() if eval_batch else {}
        result = {"eval_loss": evaluated.get("eval_loss"), "eval_metrics": evaluated}
        trainer.train()
    result["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    result["logs"] = [log for log in trainer.state.log_history if "loss" in log]  # each step's, TRL's metrics too
    result["metrics"] = result["logs"][0]
    result["weights"] = {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}
    return result
