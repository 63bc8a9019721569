"""
`embed_dataset`: prepare the model, iterate over this process's batches, gather the blocks in dataset order on the
main process, write them as they arrive.

All processes run the steps in lockstep. An exception on one of them is held until the next exchange of status
(before each gather, and once at the end), where every process raises it together; the main process then removes
its partial output.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers.utils import logging

from ..launch.environment import cpu_requested, launcher_world_size, world_size_variable
from ..launch.validation import check_whole_number
from ..saving.unwrap import unwrap_model
from .pooling import SequenceEmbedder, check_pooling, check_rows_have_tokens
from .sharding import OrderedGather, shard_batches
from .writer import OUTPUT_DTYPES, OUTPUT_SUFFIXES, EmbeddingWriter

logger = logging.get_logger(__name__)

__all__ = ["MODEL_INPUT_KEYS", "embed_dataset", "resolve_state"]

# Keys a tokenizer produces that an encoder accepts; the default collator drops everything else (ids, text columns)
# because `DataCollatorWithPadding` cannot pad strings.
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def _default_collate(tokenizer, rows: list) -> dict[str, torch.Tensor]:
    """Keep the model inputs of each row and pad them (with the tokenizer) or stack them (equal lengths)."""
    if not isinstance(rows[0], dict):
        raise TypeError(
            f"Dataset rows must be dicts with `input_ids` (got {type(rows[0]).__name__}); tokenize first, or "
            "pass a `data_collator` that builds the model inputs."
        )
    rows = [{k: v for k, v in row.items() if k in MODEL_INPUT_KEYS} for row in rows]
    if "input_ids" not in rows[0]:
        raise KeyError("Dataset rows have no `input_ids`; tokenize first or pass a `data_collator`.")
    if tokenizer is not None:
        return tokenizer.pad(rows, return_tensors="pt")
    lengths = {len(row["input_ids"]) for row in rows}
    if len(lengths) > 1:
        raise ValueError(
            f"Rows of one batch have different lengths {sorted(lengths)} and no tokenizer was given to pad "
            "them: pass `tokenizer=` (or a `data_collator`)."
        )
    return {k: torch.as_tensor(np.asarray([row[k] for row in rows])) for k in rows[0]}


def resolve_state(state=None):
    """
    The topology to embed under: `state` (an `accelerate.PartialState`, or an `Accelerator`'s), or a new
    `PartialState` that joins the process group a launcher set up.

    Raises:
        `RuntimeError`: a launcher started several processes but they formed no process group.
    """
    from accelerate import PartialState

    if state is None:
        # `PartialState()` forms a CPU (gloo) group only when told `cpu=True`, and it does not read ACCELERATE_USE_CPU
        # (only `AcceleratorState` does), which `accelerate launch` does not even set for a MULTI_GPU config with
        # `use_cpu: true` (accelerate 1.15). Without GPUs, N launched processes would run unconnected.
        state = PartialState(cpu=cpu_requested() or not torch.cuda.is_available())
    # An Accelerator exposes the same topology attributes through `.state`.
    state = getattr(state, "state", state)
    launched = launcher_world_size()
    if launched > 1 and state.num_processes == 1:
        # Without this check every process embeds the whole dataset and they race to write the same file.
        raise RuntimeError(
            f"The launcher started {launched} processes ({world_size_variable()}={launched}) but they formed no "
            f"process group (distributed_type={state.distributed_type}). On a machine without GPUs set "
            "ACCELERATE_USE_CPU=1, or launch with a config that has `use_cpu: true` "
            "(hf_parallel/configs/cpu_ddp.yaml); if you built the state yourself, pass `cpu=True`."
        )
    return state


def _iterate(
    model: nn.Module, module: nn.Module, batches: list[range], loader, state, data_parallel, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """
    Prepare, then yield this process's embeddings, one `(rows, hidden)` block per batch of `shard_batches`.

    The preparation (the model in eval mode on this process's device, the embedding `module` wrapped for
    DataParallel) runs on the first `next`, inside the steps, so that a process failing there (out of memory while
    moving the model, say) is reported to the others like a failure in a batch.
    """
    from accelerate.utils import send_to_device

    dispatched = getattr(model, "hf_device_map", None) is not None
    device = next(model.parameters()).device if dispatched else state.device
    if not dispatched:
        model.to(device)
    model.eval()
    if data_parallel is None:
        data_parallel = (
            state.num_processes == 1 and not dispatched and device.type == "cuda" and torch.cuda.device_count() > 1
        )
    if data_parallel:
        module = data_parallel(module) if callable(data_parallel) else nn.DataParallel(module)
    for rows, batch in zip(batches, loader, strict=True):
        try:
            if isinstance(batch.get("attention_mask"), torch.Tensor):
                check_rows_have_tokens(batch["attention_mask"])
            batch = send_to_device(dict(batch), device)  # a plain dict, as the model call gets it
            with torch.inference_mode():
                local = module(**batch).to(dtype)
        except ValueError as error:
            raise ValueError(f"In the batch of dataset rows {rows.start}..{rows.stop - 1}: {error}") from error
        if local.shape[0] != len(rows):
            raise RuntimeError(
                f"The model returned {local.shape[0]} embeddings for a batch of {len(rows)} rows; check the "
                "data_collator."
            )
        yield local


def _gather_and_write(
    steps: Iterator[torch.Tensor], gather: OrderedGather, writer: EmbeddingWriter | None, bar
) -> np.ndarray | None:
    """
    Run every step: embed this process's batch, gather the step's rows on the main process, write them there.

    An exception is not raised where it happens but handed to the next `gather.step` (or `gather.finish`), which
    raises it on every process at once; the failed process embeds no further batch meanwhile.
    """
    error = None
    for step in range(gather.num_steps):
        local = None
        if error is None:
            try:
                local = next(steps, None)  # None once this process has no rows left (the last steps)
            except Exception as caught:
                error = caught
        block = gather.step(step, local, error)
        if block is None:  # not the main process
            continue
        try:
            writer.write(block.cpu().numpy())
        except Exception as caught:
            error = caught
        bar.update(block.shape[0])
    result = None
    if writer is not None and error is None:
        try:
            result = writer.close()
        except Exception as caught:
            error = caught
    # Every process returns once the file is complete, so code after the call may read it on any rank.
    gather.finish(error)
    return result


def _checked_rows(dataset, batch_size: int, num_workers: int, pooling: str, dtype, output_file) -> int:
    """The rows of `dataset`, once what would fail the same way on every process is rejected, before any starts."""
    check_whole_number("batch_size", batch_size, 1)
    check_whole_number("num_workers", num_workers, 0)
    check_pooling(pooling)
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; use one of {list(OUTPUT_DTYPES)}.")
    if output_file is not None and Path(output_file).suffix not in OUTPUT_SUFFIXES:
        raise ValueError(f"output_file={str(output_file)!r} must end in .npy or .safetensors.")
    num_rows = len(dataset)
    if num_rows == 0:
        raise ValueError("The dataset is empty: there is nothing to embed.")
    return num_rows


def embed_dataset(
    model: nn.Module,
    dataset,
    *,
    batch_size: int = 32,
    pooling: str = "mean",
    layer: int = -1,
    tokenizer=None,
    data_collator: Callable[[list], dict] | None = None,
    output_file: str | os.PathLike | None = None,
    state=None,
    data_parallel: bool | Callable[[nn.Module], nn.Module] | None = None,
    use_base_model: bool = True,
    dtype: torch.dtype = torch.float32,
    num_workers: int = 0,
    progress: bool = True,
    metadata: dict[str, str] | None = None,
) -> np.ndarray | None:
    """
    Embed every row of `dataset` (one vector per sequence) with one process, DataParallel or DDP, in dataset order.

    Call it on every process. With several processes (`accelerate launch`, `torchrun`), each embeds its own rows
    (see [`shard_batches`]: no row twice, none left out), sends each batch's vectors to the main process, which
    writes them in order to `output_file` as they arrive; memory stays bounded by one step's `B*W` vectors. No
    DDP wrapping is needed for inference (there is no gradient to synchronise), so the model is used as is. If one
    process raises, every process raises a `RuntimeError` naming it and its error (e.g. `embed_dataset failed on
    rank 1: ValueError: ...`) within a step, and no output file is left behind.

    Args:
        model (`torch.nn.Module`):
            A transformers model (e.g. `AutoModelForMaskedLM`); a `DataParallel` or DDP wrapper is removed. It is put
            in eval mode for the call (its previous mode is restored) and moved to the process's device, unless it
            was dispatched with a `device_map`.
        dataset (`Sequence[dict]` or `datasets.Dataset`):
            Map-style dataset of tokenized rows (`input_ids`, optional `attention_mask`, ...).
        batch_size (`int`, *optional*, defaults to 32):
            Rows per forward per process. Under DataParallel this batch is split across the GPUs.
        pooling (`str`, *optional*, defaults to `"mean"`):
            `"mean"` (masked mean), `"cls"` (first real token) or `"last"` (last real token); see
            [`pool_hidden_states`].
        layer (`int`, *optional*, defaults to `-1`):
            Index into the model's `hidden_states` (`0` = embedding output, `-1` = last layer).
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Used to pad the rows of a batch (its `padding_side` is respected; pooling handles both sides). Models
            with absolute position embeddings that number positions from the first column (BERT, GPT-2) see
            shifted positions in a left-padded row, so their vectors then differ from the row's alone: pad those on
            the right (their tokenizers' default).
        data_collator (`Callable`, *optional*):
            Builds a batch dict from a list of rows. Defaults to padding with `tokenizer` the model inputs of each
            row (other columns are dropped), or stacking them when no tokenizer is given.
        output_file (`str` or `os.PathLike`, *optional*):
            `.npy` or `.safetensors` (tensor `"embeddings"`, shape `(len(dataset), hidden)`). Written by the main
            process only, through a `.partial` file renamed at the end.
        state (`accelerate.PartialState` or `accelerate.Accelerator`, *optional*):
            The topology; defaults to `PartialState()` (with `cpu=True` when there is no GPU or ACCELERATE_USE_CPU is
            set), which joins the process group a launcher set up.
        data_parallel (`bool` or `Callable`, *optional*):
            Single process only. `None`: use `torch.nn.DataParallel` when the process sees several GPUs. `True` /
            `False`: force it on / off. A callable wraps the embedding module instead, e.g.
            `functools.partial(hf_parallel.BalancedDataParallel, gpu0_bsz=8)`.
        use_base_model (`bool`, *optional*, defaults to `True`):
            Run `model.base_model` and skip the task head (its logits are not needed); see [`SequenceEmbedder`].
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Output dtype: float32, float16 or float64. Pooling itself runs in float32.
        num_workers (`int`, *optional*, defaults to 0):
            DataLoader workers per process.
        progress (`bool`, *optional*, defaults to `True`):
            A progress bar over the rows, on the main process only.
        metadata (`dict[str, str]`, *optional*):
            Stored in the `.safetensors` header (e.g. the model name, pooling, layer).

    Returns:
        `numpy.ndarray` of shape `(len(dataset), hidden)` on the main process, row `i` the embedding of
        `dataset[i]` (memory-mapped, read-only, from `output_file` when one is given); `None` on the others.

    ```python
    from transformers import BertConfig, BertForMaskedLM
    from hf_parallel import embed_dataset

    config = BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    rows = [{"input_ids": [2, 5, 6, 3], "attention_mask": [1, 1, 1, 1]} for _ in range(5)]
    embed_dataset(BertForMaskedLM(config), rows, batch_size=2, progress=False).shape  # (5, 8), kept in memory
    ```

    Launched with `accelerate launch --num_processes 2 script.py`, the same call embeds half the rows on each
    process and still returns all 5 rows, in order, on the main process.
    """
    num_rows = _checked_rows(dataset, batch_size, num_workers, pooling, dtype, output_file)
    state = resolve_state(state)
    world, rank = state.num_processes, state.process_index
    if data_parallel and world > 1:
        raise ValueError(
            f"data_parallel={data_parallel!r} with {world} processes: DataParallel inside a multi-process launch "
            "runs every GPU from every process. Use one or the other (drop the flag, or launch one process)."
        )
    model = unwrap_model(model)
    was_training = model.training
    # Empty rows are checked on the host, before each batch moves to the device (no sync per batch there).
    embedder = SequenceEmbedder(
        model, pooling=pooling, layer=layer, use_base_model=use_base_model, check_empty_rows=False
    )
    batches = shard_batches(num_rows, batch_size, world, rank)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=[list(b) for b in batches],
        collate_fn=data_collator or functools.partial(_default_collate, tokenizer),
        num_workers=num_workers,
    )
    gather = OrderedGather(num_rows, batch_size, world, rank, dtype, state.device)
    writer = EmbeddingWriter(output_file, num_rows, dtype, metadata) if state.is_main_process else None
    bar = logging.tqdm(total=num_rows, desc="Embedding", unit="seq", disable=not (progress and state.is_main_process))
    try:
        steps = _iterate(model, embedder, batches, loader, state, data_parallel, dtype)
        result = _gather_and_write(steps, gather, writer, bar)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    finally:
        bar.close()
        model.train(was_training)
    if result is not None and output_file is not None:
        logger.info(f"Wrote {num_rows} embeddings of size {result.shape[1]} to {output_file}.")
    return result
