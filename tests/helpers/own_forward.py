"""
A DataParallel subclass with a forward of its own, as CPU stand-ins, test doubles and some libraries write one: the
keyword tensors split by `torch.chunk`, `self.module` called on each chunk one after another (no `replicate`, no
`parallel_apply`), and the outputs gathered by a generic gather that rebuilds each container from its parts (so a
NamedTuple comes back with its parts in its first field, as `type(x)(generator)` builds it). `run_case(...,
data_parallel=chunking_data_parallel(n))` trains through it in place of `torch.nn.DataParallel`.
"""

from __future__ import annotations

import torch


def generic_gather(outputs: list, record: list[int]):
    """The outputs of every chunk as one: tensors concatenated (0-dim ones stacked), containers rebuilt from their
    gathered parts; the bytes of every tensor gathered appended to `record`."""
    first = outputs[0]
    if first is None:
        return None
    if torch.is_tensor(first):
        gathered = torch.stack(outputs) if first.dim() == 0 else torch.cat(outputs)
        record.append(gathered.numel() * gathered.element_size())
        return gathered
    if isinstance(first, dict):
        return type(first)(**{key: generic_gather([output[key] for output in outputs], record) for key in first})
    if isinstance(first, (tuple, list)):
        return type(first)(generic_gather(list(parts), record) for parts in zip(*outputs, strict=True))
    return first


def chunking_data_parallel(devices: int) -> type[torch.nn.DataParallel]:
    """
    A `torch.nn.DataParallel` subclass over `devices` virtual devices whose forward splits, runs and gathers itself
    (see the module docstring); `cls.gathered_bytes` records every tensor it gathered, `cls.chunk_sizes` every split.
    """

    class ChunkingDataParallel(torch.nn.parallel.DataParallel):
        gathered_bytes: list[int] = []
        chunk_sizes: list[list[int]] = []

        def forward(self, *inputs, **kwargs):
            if inputs:
                raise TypeError("ChunkingDataParallel takes keyword inputs")
            chunks = {key: value.chunk(devices) for key, value in kwargs.items() if torch.is_tensor(value)}
            pieces = min(len(parts) for parts in chunks.values())
            type(self).chunk_sizes.append([len(part) for part in next(iter(chunks.values()))])
            outputs = []
            for i in range(pieces):
                chunk = {key: (chunks[key][i] if key in chunks else value) for key, value in kwargs.items()}
                outputs.append(self.module(**chunk))
            return generic_gather(outputs, type(self).gathered_bytes)

    ChunkingDataParallel.gathered_bytes = []
    ChunkingDataParallel.chunk_sizes = []
    return ChunkingDataParallel
