"""
Writing embeddings as they arrive, a block of rows at a time, to a `.npy` or `.safetensors` file (or to memory).

The main process receives the rows in dataset order, so it writes each block at once and never holds them all. The
file is written under a `.partial` name and renamed when every row is in: a run that fails leaves no file that looks
complete.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = ["OUTPUT_DTYPES", "OUTPUT_SUFFIXES", "EmbeddingWriter"]

# The output dtypes: numpy's description (for .npy and memory) and the safetensors name of each.
OUTPUT_DTYPES = {
    torch.float32: ("<f4", "F32"),
    torch.float16: ("<f2", "F16"),
    torch.float64: ("<f8", "F64"),
}
OUTPUT_SUFFIXES = (".npy", ".safetensors")


class EmbeddingWriter:
    """
    Rows arrive in order, a block at a time; write them to a `.npy` or `.safetensors` file, or keep them in memory.

    The file is created on the first block (its width is not known before) under `path` + `.partial`; `close`
    renames it once all `num_rows` rows are written, `discard` removes it after an error.

    Args:
        path (`str` or `os.PathLike`, *optional*):
            The output file, ending in `.npy` or `.safetensors` (tensor `"embeddings"`). `None` keeps the rows in
            memory.
        num_rows (`int`):
            How many rows the file will hold.
        dtype (`torch.dtype`):
            float32, float16 or float64 (the keys of `OUTPUT_DTYPES`).
        metadata (`dict`, *optional*):
            Stored, as strings, in the `.safetensors` header.

    ```python
    import numpy as np
    import torch
    from hf_parallel.inference.writer import EmbeddingWriter

    writer = EmbeddingWriter(None, num_rows=3, dtype=torch.float32, metadata=None)
    writer.write(np.zeros((2, 4)))
    writer.write(np.ones((1, 4)))
    writer.close().shape  # (3, 4)
    ```
    """

    def __init__(self, path: str | os.PathLike | None, num_rows: int, dtype: torch.dtype, metadata: dict | None):
        self.path = Path(path) if path is not None else None
        self.num_rows = num_rows
        self.descr, self.st_dtype = OUTPUT_DTYPES[dtype]
        self.metadata = metadata
        self.rows_written = 0
        self.array = None
        self.offset = 0
        self.partial = None if self.path is None else self.path.with_name(self.path.name + ".partial")

    def _open(self, dim: int) -> None:
        shape = (self.num_rows, dim)
        if self.path is None:
            self.array = np.empty(shape, dtype=self.descr)
            return
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
        with open(self.partial, "wb") as file:
            file.write(struct.pack("<Q", len(encoded)) + encoded)
        # The rows follow the header, written through a map as for .npy (numpy extends the file to the full size).
        self.array = np.memmap(self.partial, dtype=self.descr, mode="r+", offset=self.offset, shape=shape)

    def write(self, block: np.ndarray) -> None:
        """Append `block` (`(rows, dim)`) after the rows written so far."""
        if self.array is None:
            self._open(block.shape[1])
        end = self.rows_written + len(block)
        self.array[self.rows_written : end] = block
        self.rows_written = end

    def discard(self) -> None:
        """After an error: release the file and remove the partial output."""
        self.array = None
        if self.path is not None and self.partial.exists():
            self.partial.unlink()

    def close(self) -> np.ndarray:
        """
        Finish the output: rename the `.partial` file to its final name.

        Returns:
            `numpy.ndarray` of shape `(num_rows, dim)`: the rows in memory, or memory-mapped (read-only) from the file.
        """
        if self.rows_written != self.num_rows:
            raise RuntimeError(f"Wrote {self.rows_written} embeddings for {self.num_rows} rows.")
        if self.path is None:
            return self.array
        shape = self.array.shape
        self.array.flush()
        self.array = None  # unmapped before the rename
        os.replace(self.partial, self.path)
        if self.path.suffix == ".npy":
            return np.load(self.path, mmap_mode="r")
        return np.memmap(self.path, dtype=self.descr, mode="r", offset=self.offset, shape=shape)
