"""Distributed batch inference: one embedding per sequence, in dataset order, written by the main process.

The second source document embeds DNA reads with a masked LM under DDP and makes three mistakes a user would hit:

1. the results stay on each rank (`results.append(...)` per process) and are never gathered;
2. `DistributedSampler` pads the dataset with duplicate samples so every rank has as many rows (7 rows on
   2 ranks give 8 results, the first row twice), and it interleaves rows, so a naive concatenation is out of order;
3. its "mean" reshapes the batch to `(batch * tokens, hidden)` and divides by the mask summed over that axis, which
   gives one vector for the whole batch, not one per sequence.

Here every process takes contiguous blocks of `batch_size` rows by index (step `k`, rank `r` gets rows
`[k*B*W + r*B, k*B*W + (r+1)*B)`), so no row is duplicated and the main process receives, at each step, the next
`B*W` rows of the dataset in order. It writes them straight to the output file: no process ever holds all the
embeddings (only the main process does, and only when no `output_file` is given).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

POOLING_METHODS = ("mean", "cls", "last")

# Keys a tokenizer produces that an encoder accepts; the default collator drops everything else (ids, text columns)
# because `DataCollatorWithPadding` cannot pad strings.
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

_OUTPUT_DTYPES = {
    torch.float32: ("<f4", "F32"),
    torch.float16: ("<f2", "F16"),
    torch.float64: ("<f8", "F64"),
}


def pool_hidden_states(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str = "mean"
) -> torch.Tensor:
    """
    Pool token states `(batch, tokens, hidden)` into one vector per sequence `(batch, hidden)`, ignoring padding.

    Works for right and left padding alike: positions come from `attention_mask`, never from the sequence length.

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, tokens, hidden)`):
            The token states of one layer.
        attention_mask (`torch.Tensor` of shape `(batch, tokens)`, *optional*):
            1 (or `True`) for real tokens, 0 for padding. `None` means no padding.
        pooling (`str`, *optional*, defaults to `"mean"`):
            `"mean"`: the mean of the real tokens' states of each row (special tokens such as `[CLS]`/`[SEP]`
            included, as the mask marks them real). `"cls"`: the state of the first real token of each row.
            `"last"`: the state of the last real token of each row (the usual choice for decoder-only models).

    Returns:
        `torch.Tensor` of shape `(batch, hidden)`, in float32 (or float64 if the states are float64): half-precision
        sums over long sequences lose digits.

    Example:

    ```python
    >>> import torch
    >>> from hf_parallel import pool_hidden_states
    >>> states = torch.tensor([[[1.0], [3.0], [100.0]], [[100.0], [2.0], [4.0]]])
    >>> mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # row 0 right-padded, row 1 left-padded
    >>> pool_hidden_states(states, mask, "mean").squeeze(-1).tolist()
    [2.0, 3.0]
    >>> pool_hidden_states(states, mask, "last").squeeze(-1).tolist()
    [3.0, 4.0]
    ```
    """
    if pooling not in POOLING_METHODS:
        raise ValueError(f"pooling={pooling!r} is not supported; use one of {POOLING_METHODS}.")
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be (batch, tokens, hidden), got shape {tuple(hidden_states.shape)}.")
    states = hidden_states if hidden_states.dtype == torch.float64 else hidden_states.float()
    batch, tokens, _ = states.shape
    if attention_mask is None:
        mask = torch.ones(batch, tokens, dtype=torch.bool, device=states.device)
    else:
        if tuple(attention_mask.shape) != (batch, tokens):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, tokens)} to match "
                "hidden_states."
            )
        mask = attention_mask.to(device=states.device) != 0
    counts = mask.sum(dim=1)
    if bool((counts == 0).any()):
        empty = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"Rows {empty} of the batch have no real token (attention_mask all 0): nothing to pool.")
    if pooling == "mean":
        # Sum per row over its own tokens and divide by its own count. (The source divides the sum over the whole
        # flattened batch by the mask summed over that same axis: one vector per batch.)
        summed = (states * mask.unsqueeze(-1).to(states.dtype)).sum(dim=1)
        return summed / counts.unsqueeze(-1).to(states.dtype)
    positions = torch.arange(tokens, device=states.device).expand(batch, tokens)
    if pooling == "cls":
        index = torch.where(mask, positions, tokens).amin(dim=1)
    else:
        index = torch.where(mask, positions, -1).amax(dim=1)
    return states[torch.arange(batch, device=states.device), index]


class SequenceEmbedder(nn.Module):
    """
    Wrap a transformers model so that its forward returns one pooled vector per sequence.

    Pooling inside the module means DataParallel gathers `(batch, hidden)` on GPU 0 instead of every layer's token
    states. For a task model (e.g. `BertForMaskedLM`) the encoder is called alone (`model.base_model`), so the LM
    head's `(batch, tokens, vocab)` logits are never computed; the token states are the same.

    Args:
        model (`transformers.PreTrainedModel` or `torch.nn.Module`):
            The model. Its forward must accept `output_hidden_states` and return `hidden_states` (all
            transformers models do), or `last_hidden_state`.
        pooling (`str`, *optional*, defaults to `"mean"`):
            `"mean"`, `"cls"` or `"last"`; see [`pool_hidden_states`].
        layer (`int`, *optional*, defaults to `-1`):
            Which entry of `hidden_states` to pool: `0` is the embedding output, `-1` the last layer.
        use_base_model (`bool`, *optional*, defaults to `True`):
            Call `model.base_model` (skip the task head). Set `False` for models whose base model output differs.

    Example:

    ```python
    >>> import torch
    >>> from transformers import BertConfig, BertForMaskedLM
    >>> from hf_parallel import SequenceEmbedder
    >>> model = BertForMaskedLM(BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
    ...                                    num_attention_heads=2, intermediate_size=16))
    >>> embedder = SequenceEmbedder(model, pooling="mean", layer=-1).eval()
    >>> embedder(input_ids=torch.tensor([[2, 5, 3, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]])).shape
    torch.Size([1, 8])
    ```
    """

    def __init__(self, model: nn.Module, pooling: str = "mean", layer: int = -1, use_base_model: bool = True):
        super().__init__()
        if pooling not in POOLING_METHODS:
            raise ValueError(f"pooling={pooling!r} is not supported; use one of {POOLING_METHODS}.")
        base = getattr(model, "base_model", None) if use_base_model else None
        self.is_base_model = isinstance(base, nn.Module)
        self.model = base if self.is_base_model else model
        self.pooling = pooling
        self.layer = layer

    def forward(self, input_ids=None, attention_mask=None, **inputs) -> torch.Tensor:
        # A base model's last layer is `last_hidden_state`: asking for every layer's states would keep
        # num_layers + 1 tensors of (batch, tokens, hidden) alive for nothing.
        use_last = self.layer == -1 and self.is_base_model
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=not use_last,
            return_dict=True,
            **inputs,
        )
        states = getattr(outputs, "last_hidden_state", None) if use_last else None
        if states is None:
            hidden_states = getattr(outputs, "hidden_states", None)
            if hidden_states is None:
                raise ValueError(f"{type(self.model).__name__} returns no hidden_states: it cannot be embedded.")
            if not -len(hidden_states) <= self.layer < len(hidden_states):
                raise ValueError(
                    f"layer={self.layer} is out of range: the model returns {len(hidden_states)} hidden states "
                    f"(use {-len(hidden_states)}..{len(hidden_states) - 1})."
                )
            states = hidden_states[self.layer]
        return pool_hidden_states(states, attention_mask, self.pooling)


def shard_batches(num_rows: int, batch_size: int, num_processes: int, process_index: int) -> list[range]:
    """
    The batches of rows one process embeds: at step `k`, process `r` takes rows `[k*B*W + r*B, k*B*W + (r+1)*B)`.

    Every row goes to exactly one process (no duplicates, unlike `DistributedSampler`'s padding), and at each step
    the processes together cover the next `B*W` rows in order, so the main process can write as it receives.
    A process's batches are a prefix of the `ceil(num_rows / (B*W))` steps; the last one may be short or absent.

    Args:
        num_rows (`int`): The dataset length.
        batch_size (`int`): Rows per batch per process (`B`).
        num_processes (`int`): The world size (`W`).
        process_index (`int`): This process's rank.

    Returns:
        `list[range]`: the row indices of each of this process's batches, in order.

    Example:

    ```python
    >>> from hf_parallel import shard_batches
    >>> [list(b) for b in shard_batches(7, 2, 2, 0)], [list(b) for b in shard_batches(7, 2, 2, 1)]
    ([[0, 1], [4, 5]], [[2, 3], [6]])
    ```
    """
    if num_rows < 0 or batch_size < 1 or num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(
            f"Need num_rows >= 0, batch_size >= 1 and 0 <= process_index < num_processes, got num_rows={num_rows}, "
            f"batch_size={batch_size}, num_processes={num_processes}, process_index={process_index}."
        )
    stride = batch_size * num_processes
    batches = []
    for start in range(process_index * batch_size, num_rows, stride):
        batches.append(range(start, min(start + batch_size, num_rows)))
    return batches


class _DefaultCollator:
    """Keep the model inputs of each row and pad them (with the tokenizer) or stack them (equal lengths)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def __call__(self, rows: list) -> dict[str, torch.Tensor]:
        if not isinstance(rows[0], dict):
            raise TypeError(
                f"Dataset rows must be dicts with `input_ids` (got {type(rows[0]).__name__}); tokenize first, or "
                "pass a `data_collator` that builds the model inputs."
            )
        rows = [{k: v for k, v in row.items() if k in MODEL_INPUT_KEYS} for row in rows]
        if "input_ids" not in rows[0]:
            raise KeyError("Dataset rows have no `input_ids`; tokenize first or pass a `data_collator`.")
        if self.tokenizer is not None:
            return self.tokenizer.pad(rows, return_tensors="pt")
        lengths = {len(row["input_ids"]) for row in rows}
        if len(lengths) > 1:
            raise ValueError(
                f"Rows of one batch have different lengths {sorted(lengths)} and no tokenizer was given to pad "
                "them: pass `tokenizer=` (or a `data_collator`)."
            )
        return {k: torch.as_tensor(np.asarray([row[k] for row in rows])) for k in rows[0]}


class _EmbeddingWriter:
    """Rows arrive in order, a block at a time; write them to a .npy or .safetensors file (or keep them in memory)."""

    def __init__(self, path: str | os.PathLike | None, num_rows: int, dtype: torch.dtype, metadata: dict | None):
        self.path = Path(path) if path is not None else None
        self.num_rows = num_rows
        self.descr, self.st_dtype = _OUTPUT_DTYPES[dtype]
        self.metadata = metadata
        self.rows_written = 0
        self.array = None
        self.file = None
        self.offset = 0
        self.dim = None
        self.partial = None if self.path is None else self.path.with_name(self.path.name + ".partial")

    def open(self, dim: int) -> None:
        self.dim = dim
        shape = (self.num_rows, dim)
        if self.path is None:
            self.array = np.empty(shape, dtype=self.descr)
            return
        # Write to a temporary name and rename at the end: a crashed run leaves no plausible-looking file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.suffix == ".npy":
            self.array = np.lib.format.open_memmap(self.partial, mode="w+", dtype=self.descr, shape=shape)
            return
        nbytes = self.num_rows * dim * np.dtype(self.descr).itemsize
        header = {"embeddings": {"dtype": self.st_dtype, "shape": list(shape), "data_offsets": [0, nbytes]}}
        if self.metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in self.metadata.items()}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the format aligns the data on 8 bytes; spaces are valid JSON
        self.offset = 8 + len(encoded)
        self.file = open(self.partial, "wb")  # noqa: SIM115 (closed in close())
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, block: np.ndarray) -> None:
        if self.array is None and self.file is None:
            self.open(block.shape[1])
        end = self.rows_written + len(block)
        if self.file is not None:
            self.file.write(np.ascontiguousarray(block, dtype=self.descr).tobytes())
        else:
            self.array[self.rows_written : end] = block
        self.rows_written = end

    def discard(self) -> None:
        """After an error: release the file and remove the partial output."""
        if self.file is not None:
            self.file.close()
        self.array = None
        if self.path is not None and self.partial.exists():
            self.partial.unlink()

    def close(self) -> np.ndarray:
        if self.rows_written != self.num_rows:
            raise RuntimeError(f"Wrote {self.rows_written} embeddings for {self.num_rows} rows.")
        if self.path is None:
            return self.array
        if self.file is not None:
            self.file.close()
            os.replace(self.partial, self.path)
            return np.memmap(
                self.path, dtype=self.descr, mode="r", offset=self.offset, shape=(self.num_rows, self.dim)
            )
        self.array.flush()
        del self.array
        os.replace(self.partial, self.path)
        return np.load(self.path, mmap_mode="r")


def _resolve_state(state):
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    if state is None:
        # `PartialState()` forms a CPU (gloo) group only when told `cpu=True`, and it does not read ACCELERATE_USE_CPU
        # (only `AcceleratorState` does), which `accelerate launch` does not even set for a MULTI_GPU config with
        # `use_cpu: true` (accelerate 1.15). Without GPUs, N launched processes would run unconnected.
        cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
        state = PartialState(cpu=cpu)
    # An Accelerator exposes the same topology attributes through `.state`.
    state = getattr(state, "state", state)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes == 1:
        # Without this check every process embeds the whole dataset and they race to write the same file.
        raise RuntimeError(
            f"The launcher started {launched} processes (WORLD_SIZE={launched}) but they formed no process group "
            f"(distributed_type={state.distributed_type}). On a machine without GPUs set ACCELERATE_USE_CPU=1, or "
            "launch with a config that has `use_cpu: true` (hf_parallel/configs/cpu_ddp.yaml); if you built the "
            "state yourself, pass `cpu=True`."
        )
    return state


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
    DDP wrapping is needed for inference (there is no gradient to synchronise), so the model is used as is.

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

    Example:

    ```python
    >>> import torch
    >>> from transformers import BertConfig, BertForMaskedLM
    >>> from hf_parallel import embed_dataset
    >>> model = BertForMaskedLM(BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
    ...                                    num_attention_heads=2, intermediate_size=16))
    >>> rows = [{"input_ids": [2, 5, 6, 3], "attention_mask": [1, 1, 1, 1]} for _ in range(5)]
    >>> embed_dataset(model, rows, batch_size=2, output_file="emb.npy", progress=False).shape
    (5, 8)
    ```

    Launched with `accelerate launch --num_processes 2 script.py`, the same call embeds half the rows on each
    process and still returns all 5 rows, in order, on the main process.
    """
    from accelerate.utils import extract_model_from_parallel

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; use one of {list(_OUTPUT_DTYPES)}.")
    if output_file is not None and Path(output_file).suffix not in (".npy", ".safetensors"):
        raise ValueError(f"output_file={str(output_file)!r} must end in .npy or .safetensors.")
    num_rows = len(dataset)
    if num_rows == 0:
        raise ValueError("The dataset is empty: there is nothing to embed.")

    state = _resolve_state(state)
    world, rank = state.num_processes, state.process_index
    model = extract_model_from_parallel(model)
    dispatched = getattr(model, "hf_device_map", None) is not None
    device = next(model.parameters()).device if dispatched else state.device
    if not dispatched:
        model.to(device)
    was_training = model.training
    model.eval()

    module: nn.Module = SequenceEmbedder(model, pooling=pooling, layer=layer, use_base_model=use_base_model)
    if data_parallel is None:
        data_parallel = world == 1 and not dispatched and device.type == "cuda" and torch.cuda.device_count() > 1
    if data_parallel:
        if world > 1:
            raise ValueError(
                f"data_parallel={data_parallel!r} with {world} processes: DataParallel inside a multi-process launch "
                "runs every GPU from every process. Use one or the other (drop the flag, or launch one process)."
            )
        module = data_parallel(module) if callable(data_parallel) else nn.DataParallel(module)

    batches = shard_batches(num_rows, batch_size, world, rank)
    num_steps = math.ceil(num_rows / (batch_size * world))
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=[list(b) for b in batches],
        collate_fn=data_collator or _DefaultCollator(tokenizer),
        num_workers=num_workers,
    )
    writer = _EmbeddingWriter(output_file, num_rows, dtype, metadata) if state.is_main_process else None
    bar = logging.tqdm(total=num_rows, desc="Embedding", unit="seq", disable=not (progress and state.is_main_process))
    dim = None
    gather_device = device if world > 1 and torch.distributed.get_backend() != "gloo" else torch.device("cpu")
    iterator = iter(loader)
    try:
        with torch.inference_mode():
            for step in range(num_steps):
                local = None
                if step < len(batches):
                    batch = next(iterator)
                    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                    try:
                        local = module(**batch).to(dtype)
                    except ValueError as error:
                        rows = batches[step]
                        raise ValueError(
                            f"In the batch of dataset rows {rows.start}..{rows.stop - 1}: {error}"
                        ) from error
                    if local.shape[0] != len(batches[step]):
                        raise RuntimeError(
                            f"The model returned {local.shape[0]} embeddings for a batch of {len(batches[step])} "
                            "rows; check the data_collator."
                        )
                if world == 1:
                    writer.write(local.cpu().numpy())
                    bar.update(local.shape[0])
                    continue
                if dim is None:
                    # Rank 0 always has rows at step 0; the others may not (fewer rows than B*W) but must send a
                    # tensor of the same shape to the collective.
                    dim_tensor = torch.tensor([local.shape[1] if rank == 0 else 0], device=gather_device)
                    torch.distributed.broadcast(dim_tensor, src=0)
                    dim = int(dim_tensor.item())
                send = torch.zeros(batch_size, dim, dtype=dtype, device=gather_device)
                if local is not None:
                    send[: local.shape[0]] = local.to(gather_device)
                received = [torch.empty_like(send) for _ in range(world)] if rank == 0 else None
                torch.distributed.gather(send, received, dst=0)
                if rank == 0:
                    base = step * batch_size * world
                    parts = []
                    for source, tensor in enumerate(received):
                        count = max(0, min(batch_size, num_rows - base - source * batch_size))
                        parts.append(tensor[:count])
                    block = torch.cat(parts).cpu().numpy()
                    writer.write(block)
                    bar.update(block.shape[0])
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    finally:
        bar.close()
        model.train(was_training)
    result = writer.close() if writer is not None else None
    if result is not None and output_file is not None:
        logger.info(f"Wrote {num_rows} embeddings of size {result.shape[1]} to {output_file}.")
    # Every process returns once the file is complete, so code after the call may read it on any rank.
    state.wait_for_everyone()
    return result


__all__ = [
    "MODEL_INPUT_KEYS",
    "POOLING_METHODS",
    "SequenceEmbedder",
    "embed_dataset",
    "pool_hidden_states",
    "shard_batches",
]
