"""
Distributed batch inference: one embedding per sequence, in dataset order, written by the main process.

Three mistakes a hand-written DDP embedding loop tends to make, which this package avoids:

1. the results stay on each rank (`results.append(...)` per process) and are never gathered;
2. `DistributedSampler` pads the dataset with duplicate samples so every rank has as many rows (7 rows on
   2 ranks give 8 results, the first row twice), and it interleaves rows, so a naive concatenation is out of order;
3. a "mean" that reshapes the batch to `(batch * tokens, hidden)` and divides by the mask summed over that axis
   gives one vector for the whole batch, not one per sequence.

Here every process takes contiguous blocks of rows by index ([`shard_batches`]), so no row is duplicated and the
main process receives, at each step, the next rows of the dataset in order; it writes them straight to the output
file, so no process ever holds all the embeddings (only the main process does, and only when no `output_file` is
given). The modules: `pooling` (pooling and the embedding module), `sharding` (which rows each process embeds, and the
ordered gather), `writer` (the streamed `.npy` / `.safetensors` writer), `embed` (`embed_dataset`).
"""

from .embed import MODEL_INPUT_KEYS, embed_dataset
from .pooling import POOLING_METHODS, SequenceEmbedder, pool_hidden_states
from .sharding import shard_batches

__all__ = [
    "MODEL_INPUT_KEYS",
    "POOLING_METHODS",
    "SequenceEmbedder",
    "embed_dataset",
    "pool_hidden_states",
    "shard_batches",
]
