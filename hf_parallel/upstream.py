"""
The upstream contract: every hook and attribute of `transformers.Trainer` and accelerate that hf_parallel relies on,
in one table, so that an upgrade that changes one fails a test (tests/test_upstream.py) instead of training wrongly.

Public hooks are overridden with their exact signatures; private ones (`_`-prefixed) only where no public hook
exists. Attributes are read or set around a call to the stock method (`temporarily`).

`CHECKED_IN` names the releases in which every row was checked: CI (.ci/run) runs the whole suite on transformers
5.19.0 (the oldest supported) and on what a fresh install resolves to (5.25.0 when this was written), and
tests/test_upstream.py, tests/test_fsdp2.py and tests/saving/test_resume.py on 5.24.0 as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = [
    "CALLED",
    "CHECKED_IN",
    "GRADIENT_STATE_ATTRIBUTES",
    "HOOKS",
    "IMPORTED_NAMES",
    "INSTANCE_ATTRIBUTES",
    "NOT_OVERRIDDEN",
    "PRIVATE_ATTRIBUTES",
    "PRIVATE_NAMES",
    "SHARD_ATTRIBUTES",
    "TRAINING_ATTRIBUTES",
    "Hook",
    "PrivateName",
    "temporarily",
]

# (transformers, accelerate) pairs in which every row of this module was checked (tests/test_upstream.py in CI).
CHECKED_IN = (("5.19.0", "1.15.0"), ("5.24.0", "1.16.0"), ("5.25.0", "1.16.0"))


class Hook(NamedTuple):
    """A method of a transformers Trainer class (`owner`) that hf_parallel overrides or calls, with its parameters."""

    name: str
    parameters: tuple[str, ...]
    why: str
    owner: str = "Trainer"


HOOKS = (
    Hook("compute_loss", ("self", "model", "inputs", "return_outputs", "num_items_in_batch"), "the exact loss"),
    Hook("training_step", ("self", "model", "inputs", "num_items_in_batch"), "no second division by GA steps"),
    Hook("get_batch_samples", ("self", "epoch_iterator", "num_batches", "device"), "count the step before it runs"),
    Hook(
        "evaluation_loop",
        ("self", "dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix"),
        "exact eval_loss",
    ),
    Hook("get_train_dataloader", ("self",), "count the samples of an iterable set each rank reads itself"),
    Hook("train", ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"), "DDP after evaluate()"),
    Hook("_finalize_training", ("self", "trial", "num_train_samples", "start_time"), "exact train_loss under DDP"),
    Hook("_get_num_items_in_batch", ("self", "batch_samples", "device"), "the stock count, on fallback"),
    Hook("_wrap_model", ("self", "model", "training", "dataloader"), "BalancedDataParallel"),
    Hook("_save", ("self", "output_dir", "state_dict"), "no wrapper prefixes in checkpoints"),
    Hook("_load_from_checkpoint", ("self", "resume_from_checkpoint", "model"), "resume across wrappers"),
    Hook("_load_best_model", ("self",), "best model across wrappers"),
    Hook("_save_checkpoint", ("self", "model", "trial"), "crash-safe checkpoints: staged, then renamed whole"),
    Hook("_load_rng_state", ("self", "checkpoint"), "a defined random state for a rank the checkpoint has none for"),
    Hook("_save_optimizer_and_scheduler", ("self", "output_dir"), "the optimizer state of a model sharded at load"),
    Hook("_load_optimizer_and_scheduler", ("self", "checkpoint"), "a sharded model's optimizer state on any layout"),
    Hook(
        "prediction_step",
        ("self", "model", "inputs", "prediction_loss_only", "ignore_keys", "gen_kwargs"),
        "exact eval_loss with predict_with_generate",
        owner="Seq2SeqTrainer",
    ),
)

# Methods of the stock Trainer that hf_parallel calls without overriding them: (name, parameters, why).
CALLED = (
    ("get_tp_size", ("self",), "tensor parallelism shares batches across ranks: no exact loss"),
    ("get_cp_size", ("self",), "context parallelism shares batches across ranks: no exact loss"),
    ("get_sp_size", ("self",), "sequence parallelism: exact under DeepSpeed Ulysses, its gradient combination"),
    ("compute_loss_context_manager", ("self",), "Seq2SeqTrainer's exact eval_loss next to generation"),
    ("_prepare_inputs", ("self", "inputs"), "Seq2SeqTrainer's exact eval_loss next to generation"),
    ("_get_output_dir", ("self", "trial"), "a checkpoint's run folder: the staging folder while it is written"),
    ("_push_from_checkpoint", ("self", "checkpoint_folder"), "a checkpoint goes to the Hub once it is complete"),
)
# Hooks of newer releases that hf_parallel leaves to stock, with the release that added them and why stock's is right.
NOT_OVERRIDDEN = (
    (
        "get_resumed_dataloader",
        "5.25.0",
        "resuming mid-epoch skips the trained batches with accelerate's skip_first_batches, which keeps the epoch's "
        "remainder (accelerate >= 1.16): the exact loss of the rest of the epoch holds (tests/saving/test_resume.py)",
    ),
)

# Attributes of a constructed Trainer (or of what it holds) that hf_parallel reads or sets: (owner, name, why).
INSTANCE_ATTRIBUTES = (
    ("trainer", "loss_is_scaled_for_ga", "set while the exact loss is already divided by the step's count"),
    ("trainer", "_loss_shifts_labels", "the count for a compute_loss_func is of shifted labels"),
    ("trainer", "compute_loss_func", "a user loss keeps its place, fed the exact count"),
    ("trainer", "model_wrapped", "DDP wrapper: released at exit, repaired after evaluate()"),
    ("trainer", "label_names", "the label keys of the exact loss"),
    ("trainer", "model_accepts_loss_kwargs", "stock passes num_items_in_batch to such models"),
    ("accelerator", "_models", "accelerate's prepared models: the DDP wrapper lives there too"),
    ("accelerator", "gradient_state", "the active dataloader: at its end, which samples of its last batch are real"),
    ("accelerator", "mixed_precision", "the autocast dtype inside DataParallel replicas (no prepare for DP)"),
    ("accelerator", "num_processes", "the data-parallel size: S / C is scaled by it (DDP and FSDP average gradients)"),
    ("accelerator", "process_index", "which rows of the epoch's last batch are this rank's real ones"),
    ("accelerator", "distributed_type", "what runs: DDP, FSDP, DeepSpeed, one process (the sharding downgrade)"),
    ("accelerator", "even_batches", "whether the last batch of an epoch is padded with repeated rows"),
    ("trainer", "is_fsdp_enabled", "no plain state-dict loading of an FSDP checkpoint"),
    ("trainer", "is_deepspeed_enabled", "no plain state-dict loading of a DeepSpeed checkpoint"),
    ("trainer", "callback_handler", "Gpu0BszAdvisorCallback gets the exact loss's settled head"),
)
# Attributes of accelerate's `GradientState` that `hf_parallel.exact.remainder` and `streams` read at an epoch's end.
GRADIENT_STATE_ATTRIBUTES = ("active_dataloader", "end_of_dataloader", "remainder", "num_steps")
# Attributes of accelerate's `IterableDatasetShard` (an iterable dataset each rank reads itself) that
# `hf_parallel.exact.streams` reads, or sets (`dataset`), to count its samples.
SHARD_ATTRIBUTES = ("dataset", "batch_size", "num_processes", "split_batches", "drop_last")
# Set only during training, read by `_finalize_training`.
TRAINING_ATTRIBUTES = (("trainer", "_tr_loss", "this rank's loss not logged yet"),)
# Private or undocumented state of what accelerate and transformers make, read or written where no public name says
# the same: (owner, name, why). A rename would not fail, it would silently change what runs. The owners, as
# tests/test_upstream.py makes them: "prepared model" (what `Accelerator.prepare` returns for a model),
# "DataLoaderShard" (what it returns for a DataLoader), "accelerator", "PreTrainedModel" (a transformers model after a
# forward that records its hidden states).
PRIVATE_ATTRIBUTES = (
    (
        "prepared model",
        "_is_accelerate_prepared",
        "accelerate's mark on a model it prepared, which it then never wraps again: Trainer.train() unmarks the "
        "model evaluate() prepared under DDP, so that training wraps it",
    ),
    (
        "DataLoaderShard",
        "_drop_last",
        "whether accelerate drops an epoch's uneven last batch: ExactLoop then marks no padding rows in it",
    ),
    (
        "DataLoaderShard",
        "end_of_dataloader",
        "ExactLoop writes it on the active dataloader (GradientState.end_of_dataloader reads it there), so that "
        "accumulate() syncs at the last micro-batch of an epoch's last step only",
    ),
    (
        "accelerator",
        "step",
        "ExactLoop writes the micro-batch count that accumulate() adds one to and syncs on (a multiple of the "
        "accumulation steps)",
    ),
    (
        "PreTrainedModel",
        "_output_capturing_hooks_installed",
        "transformers' mark on a model whose forward installed its output-capturing hooks: install_output_hooks "
        "leaves those models alone (renamed, DataParallel replicas would get the hooks twice)",
    ),
)
# Names imported from modules of accelerate and transformers that their documentation does not list:
# (module, name, why).
IMPORTED_NAMES = (
    (
        "accelerate.commands.config",
        "default_config_file",
        "`hf-parallel env` reports accelerate's default config (a guarded import: unknown without it)",
    ),
    (
        "transformers.utils.output_capturing",
        "maybe_install_capturing_hooks",
        "install_output_hooks installs the hooks once before replicating (a guarded import: without it, nothing is "
        "installed and each replica installs them)",
    ),
    (
        "transformers.trainer",
        "_is_peft_model",
        "a checkpoint of a PEFT model is loaded by its own loader, not as plain weights (_plain_weights_checkpoint); "
        "the Trainer module's own test, so a PEFT model counts as stock counts it",
    ),
    (
        "transformers.trainer",
        "deepspeed_load_checkpoint",
        "the DeepSpeed resume the training loop calls by this module-level name: Trainer.train() swaps it for "
        "engines.reshard.load_on_any_world_size, which calls it on the checkpoint's own world size",
    ),
)


class PrivateName(NamedTuple):
    """
    A private name of torch, DeepSpeed, transformers, accelerate or TRL that hf_parallel reads, writes, patches or
    imports, where no public name does the same: `name` on `owner` (a dotted path to a module or class), or, for state
    made at run time (an instance attribute), a name that `source` (a dotted path to a module or class) still reads or
    writes.
    """

    owner: str
    name: str
    why: str
    source: str | None = None


PRIVATE_NAMES = (
    # torch: the launch guard, the stock loss's watched count, DataParallel (its replicas and the CPU emulation)
    PrivateName("torch.cuda", "_lazy_call", "CUDA_VISIBLE_DEVICES recorded as CUDA initialises (guarded)"),
    PrivateName("torch._C", "DisableTorchFunctionSubclass", "a watched count runs each op on plain tensors"),
    PrivateName("torch.Tensor", "_make_subclass", "a watched count shares the storage of the count it watches"),
    PrivateName("torch.nn.modules.batchnorm", "_BatchNorm", "batch statistics split over replicas: warned"),
    PrivateName("torch.nn.Module", "_parameters", "replicas' parameters routed", "torch.nn.parallel.replicate"),
    PrivateName("torch._dynamo.eval_frame.OptimizedModule", "_orig_mod", "unwrapped", "torch._dynamo.eval_frame"),
    PrivateName("torch.distributed.distributed_c10d", "_get_default_store", "ZeRO-3 saves' arrivals, with a deadline"),
    PrivateName("torch._utils", "_get_device_index", "the emulation maps device ids to its virtual devices"),
    PrivateName("torch.nn.parallel", "_functions", "the emulation runs torch's own Broadcast and Gather"),
    # the emulation stands in for the copies between GPUs (`_broadcast_coalesced`, `_scatter`, `_gather`)
    PrivateName("torch._C", "_scatter", "what torch's scatter calls", "torch.nn.parallel.comm"),
    # DeepSpeed 0.19: a ZeRO checkpoint resumed on another number of ranks (engines.reshard), its checks
    PrivateName("deepspeed.utils.zero_to_fp32", "_get_fp32_state_dict_from_zero2_checkpoint", "ZeRO 1/2 merged"),
    PrivateName("deepspeed.utils.zero_to_fp32", "_get_fp32_state_dict_from_zero3_checkpoint", "ZeRO-3 merged"),
    PrivateName(
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
        "_get_fp32_opt_state_partition",
        "a partition written directly: DeepSpeed's own setter reads past a padded end",
    ),
    PrivateName(
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_get_param_partition_rank", "its rank"
    ),
    PrivateName(
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
        "_lazy_init_hp_params_optimizer_state",
        "ZeRO 1/2 link each parameter's view of an optimizer state made before its first step",
    ),
    PrivateName(
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
        "_hp_optimizer_states_linked",
        "unset, so that the views are linked again",
        source="deepspeed.runtime.zero.stage_1_and_2",
    ),
    PrivateName("deepspeed.runtime.engine.DeepSpeedEngine", "_broadcast_model", "bytes broadcast: 0-dim refused"),
    # transformers
    PrivateName("transformers.PreTrainedModel", "_loss_function", "LossCallWatch's", "transformers.modeling_utils"),
    PrivateName("transformers.PreTrainedModel", "_keys_to_ignore_on_save", "weights a checkpoint leaves out"),
    PrivateName(
        "transformers.models.wav2vec2.modeling_wav2vec2.Wav2Vec2PreTrainedModel",
        "_get_feat_extract_output_lengths",
        "each utterance's frames, for a CTC model that computes its loss inline",
    ),
    PrivateName(
        "transformers.loss.loss_lw_detr", "_is_torch_distributed_initialized", "LW-DETR's box count (guarded)"
    ),
    PrivateName("transformers.TrainingArguments", "_setup_devices", "the emulation sets up devices, then n_gpu"),
    PrivateName("transformers.TrainingArguments", "_n_gpu", "what n_gpu reads", "transformers.training_args"),
    # accelerate
    PrivateName("accelerate.state.PartialState", "_shared_state", "cpu_as_accelerator comes too late once it exists"),
    # TRL (a test extra; checked where it is installed): KTO's KL forwards, run once a step and then given; GRPO's and
    # RLOO's micro-batch counter, which says where a generation batch starts, set as each micro-batch will have it
    PrivateName("trl.KTOTrainer", "_compute_kl_logps", "KTO's KL reference point over the whole step"),
    # their logged metrics, one value a micro-batch, weighted by its items before TRL averages them
    PrivateName("trl.SFTTrainer", "_metrics", "the step's token accuracy and entropy", "trl.SFTTrainer"),
    PrivateName("trl.DPOTrainer", "_metrics", "the step's reward accuracies and margins", "trl.DPOTrainer"),
    PrivateName("trl.RewardTrainer", "_metrics", "the step's accuracy and margin", "trl.RewardTrainer"),
    PrivateName("trl.GRPOTrainer", "_step", "a step's completions generated before it is counted", "trl.GRPOTrainer"),
    PrivateName("trl.RLOOTrainer", "_step", "a step's completions generated before it is counted", "trl.RLOOTrainer"),
)


@contextlib.contextmanager
def temporarily(obj: Any, name: str, value: Any) -> Iterator[None]:
    """
    Set `obj.name = value` for the block, then restore it, whatever happens: the way to call a stock method with
    one of its inputs changed when it offers no parameter for it. A method or any other attribute of the class, set on
    the instance within, is removed from it afterwards, so that the class's shows through again.

    ```python
    from hf_parallel.upstream import temporarily

    with temporarily(trainer, "model", inner):
        transformers.Trainer._save(trainer, output_dir)  # saves the inner model
    ```
    """
    own = name in getattr(obj, "__dict__", {})
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own or name not in getattr(obj, "__dict__", {}):
            setattr(obj, name, previous)
        else:
            delattr(obj, name)
