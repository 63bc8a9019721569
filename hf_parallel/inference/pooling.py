"""Pooling token states into one vector per sequence, ignoring padding, and a module that embeds with a model."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["POOLING_METHODS", "SequenceEmbedder", "check_rows_have_tokens", "pool_hidden_states"]

POOLING_METHODS = ("mean", "cls", "last")


def check_pooling(pooling: str) -> None:
    """Raise a `ValueError` naming `pooling` and the methods there are, unless it is one of `POOLING_METHODS`."""
    if pooling not in POOLING_METHODS:
        raise ValueError(f"pooling={pooling!r} is not supported; use one of {POOLING_METHODS}.")


def check_rows_have_tokens(attention_mask: torch.Tensor) -> None:
    """Raise a `ValueError` naming the rows of `(batch, tokens)` `attention_mask` that have no real token. It reads
    the mask's values: on an accelerator, a device-to-host sync (check the mask before moving it there)."""
    empty = torch.nonzero(attention_mask.ne(0).sum(dim=1) == 0).flatten().tolist()
    if empty:
        raise ValueError(f"Rows {empty} of the batch have no real token (attention_mask all 0): nothing to pool.")


def pool_hidden_states(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pooling: str = "mean",
    *,
    check_empty_rows: bool = True,
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
        check_empty_rows (`bool`, *optional*, defaults to `True`):
            Raise a `ValueError` for a row without any real token (its mean would be NaN). The check reads the mask
            back (a sync on an accelerator); pass `False` when the mask was checked before it was moved there
            (`check_rows_have_tokens`), as `embed_dataset` does.

    Returns:
        `torch.Tensor` of shape `(batch, hidden)`, in float32 (or float64 if the states are float64): half-precision
        sums over long sequences lose digits.

    Example:

    ```python
    import torch
    from hf_parallel import pool_hidden_states

    states = torch.tensor([[[1.0], [3.0], [100.0]], [[100.0], [2.0], [4.0]]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # row 0 right-padded, row 1 left-padded
    pool_hidden_states(states, mask, "mean").squeeze(-1).tolist()  # [2.0, 3.0]
    pool_hidden_states(states, mask, "last").squeeze(-1).tolist()  # [3.0, 4.0]
    ```
    """
    check_pooling(pooling)
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
    if check_empty_rows:
        check_rows_have_tokens(mask)
    if pooling == "mean":
        # Sum per row over its own tokens and divide by its own count. Reshaping to (batch * tokens, hidden) first and
        # dividing by the mask summed over that axis, a common mistake, gives one vector for the whole batch.
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
        check_empty_rows (`bool`, *optional*, defaults to `True`):
            See [`pool_hidden_states`].

    Example:

    ```python
    import torch
    from transformers import BertConfig, BertForMaskedLM
    from hf_parallel import SequenceEmbedder

    config = BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    embedder = SequenceEmbedder(BertForMaskedLM(config), pooling="mean", layer=-1).eval()
    embedder(input_ids=torch.tensor([[2, 5, 3, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]])).shape  # (1, 8)
    ```
    """

    def __init__(
        self,
        model: nn.Module,
        pooling: str = "mean",
        layer: int = -1,
        use_base_model: bool = True,
        check_empty_rows: bool = True,
    ):
        super().__init__()
        self.check_empty_rows = check_empty_rows
        check_pooling(pooling)
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
        return pool_hidden_states(states, attention_mask, self.pooling, check_empty_rows=self.check_empty_rows)
