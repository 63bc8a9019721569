"""Batch inference: per-sequence pooling, dataset order, one row per input, 1 process == 2-rank DDP, a failing rank.
The example that embeds reads (examples/embed.py): test_examples.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.state import DistributedType
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file
from torch.utils.data.distributed import DistributedSampler

from examples import embed as embed_example
from hf_parallel import BalancedDataParallel, SequenceEmbedder, embed_dataset, pool_hidden_states, shard_batches
from hf_parallel.inference import embed as embed_module
from hf_parallel.testing import simulate_data_parallel, spawn_cpu_ranks

# Embedding runs on the CPU here: with a GPU, embed_dataset would move the model to it (and wrap it in DataParallel
# with several), while the references below run it on the CPU. The ranks of the DDP tests ask for the CPU themselves.
pytestmark = pytest.mark.usefixtures("no_gpus")

ATOL = 1e-5
# (rows, batch size per process, pooling, padding side): sizes not divisible by 2 ranks nor by the batch, and one
# where rank 1 gets nothing at all (1 row).
DDP_CASES = [(7, 2, "mean", "right"), (29, 4, "last", "left"), (1, 4, "cls", "right")]


def tiny_setup(padding_side: str = "right", seed: int = 0):
    tokenizer = embed_example.char_tokenizer()
    tokenizer.padding_side = padding_side
    model = embed_example.tiny_masked_lm(tokenizer, max_length=40, seed=seed)
    if padding_side == "left":
        # BERT numbers positions from the first column, so a left-padded row would see shifted positions and differ
        # from the row alone for a reason that is the model's, not the pooling's. Without position embeddings
        # only the attention mask separates real tokens from padding, which is what these tests check.
        with torch.no_grad():
            model.bert.embeddings.position_embeddings.weight.zero_()
    return model, tokenizer


def dna_rows(tokenizer, n: int, seed: int = 0) -> list[dict]:
    """n DNA sequences of 3-30 bases, of varied lengths so every batch is padded."""
    rng = np.random.default_rng(seed)
    seqs = ["".join(rng.choice(list("ACGT"), size=rng.integers(3, 31))) for _ in range(n)]
    enc = tokenizer(seqs)
    return [
        {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i], "id": f"s{i}"} for i in range(n)
    ]


def one_by_one(model, rows, pooling="mean", layer=-1) -> np.ndarray:
    """Ground truth: each sequence alone through the full masked LM, no padding, pooled by hand."""
    model.eval()
    out = []
    with torch.no_grad():
        for row in rows:
            states = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states[layer]
            states = states[0]
            out.append({"mean": states.mean(0), "cls": states[0], "last": states[-1]}[pooling].numpy())
    return np.stack(out)


# --- pooling ------------------------------------------------------------------------------------------------------


def _padded_batch():
    torch.manual_seed(0)
    states = torch.randn(4, 5, 3)
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0],  # right-padded, 3 real tokens
            [0, 0, 1, 1, 1],  # left-padded, 3 real tokens
            [1, 1, 1, 1, 1],  # no padding
            [0, 0, 0, 0, 1],  # left-padded, 1 real token
        ]
    )
    return states, mask


def test_pooling_equals_hand_computation_right_and_left_padding():
    states, mask = _padded_batch()
    real = [[t for t in range(5) if mask[b, t]] for b in range(4)]
    hand_mean = torch.stack([sum(states[b, t] for t in real[b]) / len(real[b]) for b in range(4)])
    hand_cls = torch.stack([states[b, real[b][0]] for b in range(4)])
    hand_last = torch.stack([states[b, real[b][-1]] for b in range(4)])
    torch.testing.assert_close(pool_hidden_states(states, mask, "mean"), hand_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(pool_hidden_states(states, mask, "cls"), hand_cls, atol=0, rtol=0)
    torch.testing.assert_close(pool_hidden_states(states, mask, "last"), hand_last, atol=0, rtol=0)
    # Boolean masks and no mask at all.
    torch.testing.assert_close(pool_hidden_states(states, mask.bool(), "mean"), hand_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(pool_hidden_states(states, None, "mean"), states.mean(1), atol=1e-6, rtol=0)


def test_flattened_batch_mean_is_one_vector_per_batch():
    """The control: reshaping the batch to (batch * tokens, hidden) before the sum gives one vector per batch."""
    states, mask = _padded_batch()
    bs, nt, ed = states.shape
    flat = states.reshape(bs * nt, ed)
    flat_mask = mask.unsqueeze(-1).reshape(bs * nt, -1)
    flattened = torch.sum(flat_mask * flat, axis=-2) / torch.sum(flat_mask, axis=0)
    ours = pool_hidden_states(states, mask, "mean")
    assert flattened.shape == (ed,) and ours.shape == (bs, ed)
    for row in range(bs):
        assert not torch.allclose(ours[row], flattened, atol=1e-3), row


def test_pooling_rejects_bad_input():
    states, mask = _padded_batch()
    with pytest.raises(ValueError, match=r"pooling='max'.*mean"):
        pool_hidden_states(states, mask, "max")
    with pytest.raises(ValueError, match=r"Rows \[1\] .* no real token"):
        pool_hidden_states(states, torch.tensor([[1] * 5, [0] * 5, [1] * 5, [1] * 5]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(4, 4\)"):
        pool_hidden_states(states, mask[:, :4])


def test_half_precision_states_pool_in_float32():
    states, mask = _padded_batch()
    pooled = pool_hidden_states(states.half(), mask, "mean")
    assert pooled.dtype == torch.float32
    torch.testing.assert_close(pooled, pool_hidden_states(states.half().float(), mask), atol=1e-6, rtol=0)


def test_sequence_embedder_base_model_and_layers_match_full_model():
    model, tokenizer = tiny_setup()
    rows = dna_rows(tokenizer, 4)
    batch = tokenizer.pad([{k: r[k] for k in ("input_ids", "attention_mask")} for r in rows], return_tensors="pt")
    model.eval()
    with torch.no_grad():
        full = model(**batch, output_hidden_states=True).hidden_states
        for layer in (-1, 0, 1):
            for use_base in (True, False):
                got = SequenceEmbedder(model, "mean", layer, use_base_model=use_base)(**batch)
                want = pool_hidden_states(full[layer], batch["attention_mask"])
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=f"layer={layer} base={use_base}")
        with pytest.raises(ValueError, match=r"layer=7 is out of range.*3 hidden states"):
            SequenceEmbedder(model, "mean", 7)(**batch)


# --- sharding -----------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), batch=st.integers(1, 17), world=st.integers(1, 5))
def test_shard_batches_covers_every_row_once_in_order(n, batch, world):
    shards = [shard_batches(n, batch, world, r) for r in range(world)]
    steps = -(-n // (batch * world))
    order = []
    for step in range(steps):
        for r in range(world):
            if step < len(shards[r]):
                order.extend(shards[r][step])
    assert order == list(range(n))  # each row once, and step-major/rank-minor order is the dataset order
    for r in range(world):
        assert all(len(b) >= 1 for b in shards[r])
        assert len(shards[r]) <= steps


def test_shard_batches_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"process_index=2 is not a rank of 2 processes; use 0\.\.1"):
        shard_batches(10, 2, 2, 2)
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1, got 0"):
        shard_batches(10, 0, 2, 0)
    with pytest.raises(ValueError, match="num_rows must be a whole number >= 0, got -1"):
        shard_batches(-1, 2, 2, 0)


def test_distributed_sampler_duplicates_and_reorders():
    """The control for DDP: a DistributedSampler gives 8 rows for 7 and interleaves them."""
    data = list(range(7))
    per_rank = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=False)) for r in range(2)]
    concatenated = per_rank[0] + per_rank[1]
    assert len(concatenated) == 8 and concatenated.count(0) == 2
    assert concatenated != data
    ours = [i for r in range(2) for b in shard_batches(7, 2, 2, r) for i in b]
    assert sorted(ours) == data


# --- one process --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_one_process_equals_each_sequence_alone(pooling, padding_side):
    model, tokenizer = tiny_setup(padding_side)
    rows = dna_rows(tokenizer, 11)
    got = embed_dataset(model, rows, batch_size=4, pooling=pooling, tokenizer=tokenizer, progress=False)
    assert model.training  # its mode is restored
    assert got.shape == (11, 32)
    np.testing.assert_allclose(got, one_by_one(model, rows, pooling), atol=ATOL, rtol=0)


def test_output_files_and_errors(tmp_path):
    model, tokenizer = tiny_setup()
    rows = dna_rows(tokenizer, 9)
    common = dict(batch_size=4, tokenizer=tokenizer, progress=False)
    in_memory = embed_dataset(model, rows, **common)
    as_npy = embed_dataset(model, rows, output_file=tmp_path / "e.npy", state=Accelerator(cpu=True), **common)
    as_st = embed_dataset(model, rows, output_file=tmp_path / "sub" / "e.safetensors", metadata={"k": "v"}, **common)
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), in_memory)
    np.testing.assert_array_equal(np.asarray(as_npy), in_memory)
    np.testing.assert_array_equal(load_file(tmp_path / "sub" / "e.safetensors")["embeddings"], in_memory)
    np.testing.assert_array_equal(np.asarray(as_st), in_memory)
    with safe_open(tmp_path / "sub" / "e.safetensors", "np") as f:
        assert f.metadata() == {"k": "v"}
    assert not list(tmp_path.rglob("*.partial"))
    half = embed_dataset(model, rows, dtype=torch.float16, output_file=tmp_path / "h.safetensors", **common)
    assert load_file(tmp_path / "h.safetensors")["embeddings"].dtype == np.float16
    np.testing.assert_allclose(np.asarray(half, dtype=np.float32), in_memory, atol=1e-2, rtol=1e-2)

    # A failure mid-way leaves no file behind, partial or not.
    with pytest.raises(ValueError, match=r"dataset rows 4..5: Rows \[1\] of the batch have no real token"):
        embed_dataset(
            model,
            rows[:5] + [{"input_ids": [0, 0], "attention_mask": [0, 0]}],
            **common,
            output_file=tmp_path / "f.safetensors",
        )
    assert not (tmp_path / "f.safetensors").exists() and not (tmp_path / "f.safetensors.partial").exists()
    with pytest.raises(ValueError, match=r"output_file='x.csv' must end in \.npy or \.safetensors"):
        embed_dataset(model, rows, output_file="x.csv", **common)
    with pytest.raises(ValueError, match="dataset is empty"):
        embed_dataset(model, [], **common)
    with pytest.raises(ValueError, match=r"different lengths \[5, 6\] and no tokenizer"):
        embed_dataset(model, [{"input_ids": [2, 5, 6, 7, 3]}, {"input_ids": [2, 5, 6, 7, 8, 3]}], progress=False)


def test_hf_datasets_dataset_with_extra_columns():
    datasets = pytest.importorskip("datasets")  # absent from some GPU images, where the suite must still run

    model, tokenizer = tiny_setup()
    rows = dna_rows(tokenizer, 5)
    table = datasets.Dataset.from_list(rows)  # has a string column "id", which the default collator drops
    got = embed_dataset(model, table, batch_size=2, tokenizer=tokenizer, progress=False)
    np.testing.assert_allclose(got, one_by_one(model, rows), atol=ATOL, rtol=0)


def test_mis_launch_is_an_error(monkeypatch):
    """Processes started by a launcher that formed no group would each embed everything and race on the file."""
    model, tokenizer = tiny_setup()
    monkeypatch.setenv("WORLD_SIZE", "2")
    lone = SimpleNamespace(num_processes=1, process_index=0, distributed_type=DistributedType.NO)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*ACCELERATE_USE_CPU=1"):
        embed_dataset(model, dna_rows(tokenizer, 3), state=lone, tokenizer=tokenizer, progress=False)
    # MPI launchers name the world size otherwise.
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("PMI_SIZE", "3")
    with pytest.raises(RuntimeError, match=r"started 3 processes \(PMI_SIZE=3\)"):
        embed_dataset(model, dna_rows(tokenizer, 3), state=lone, tokenizer=tokenizer, progress=False)


def test_data_parallel_path_matches_one_process():
    model, tokenizer = tiny_setup("left")
    rows = dna_rows(tokenizer, 7)
    want = embed_dataset(model, rows, batch_size=3, tokenizer=tokenizer, progress=False)
    # torch's nn.DataParallel over 2 virtual devices (the emulation: torch's own scatter, replicas and gather).
    with simulate_data_parallel(2) as emulation:
        got_dp = embed_dataset(model, rows, batch_size=3, tokenizer=tokenizer, progress=False, data_parallel=True)
    np.testing.assert_allclose(got_dp, want, atol=ATOL, rtol=0)
    assert emulation.chunk_sizes and all(split in ([2, 1], [1]) for split in emulation.chunk_sizes)
    assert [2, 1] in emulation.chunk_sizes and set(emulation.replica_devices) == {0, 1}
    # A callable wraps instead: BalancedDataParallel with 1 row on GPU 0 out of each batch of 3 on 3 devices.
    wrappers = []

    def balanced(module):
        wrappers.append(BalancedDataParallel(module, gpu0_bsz=1))
        return wrappers[-1]

    with simulate_data_parallel(3) as emulation:
        got_balanced = embed_dataset(
            model, rows, batch_size=3, tokenizer=tokenizer, progress=False, data_parallel=balanced
        )
    np.testing.assert_allclose(got_balanced, want, atol=ATOL, rtol=0)
    assert len(wrappers) == 1 and wrappers[0].device_ids == [0, 1, 2]
    assert emulation.chunk_sizes and all(split in ([1, 1, 1], [1]) for split in emulation.chunk_sizes)
    assert [1, 1, 1] in emulation.chunk_sizes
    # Real torch.nn.DataParallel on a machine without GPUs runs the module directly; and a model the user already
    # wrapped is unwrapped first.
    got_torch_dp = embed_dataset(model, rows, batch_size=3, tokenizer=tokenizer, progress=False, data_parallel=True)
    np.testing.assert_allclose(got_torch_dp, want, atol=ATOL, rtol=0)
    got_wrapped = embed_dataset(torch.nn.DataParallel(model), rows, batch_size=3, tokenizer=tokenizer, progress=False)
    np.testing.assert_allclose(got_wrapped, want, atol=ATOL, rtol=0)


# --- two ranks ----------------------------------------------------------------------------------------------------


def _ddp_worker(out_dir: str):
    state = PartialState(cpu=True)
    assert state.num_processes == 2 and dist.get_world_size() == 2
    assert state.distributed_type == DistributedType.MULTI_CPU
    rank = state.process_index
    bars = []  # the progress bar's `disable` flag, per call: shown on rank 0 only
    real_tqdm = embed_module.logging.tqdm
    embed_module.logging.tqdm = lambda *args, **kwargs: bars.append(kwargs["disable"]) or real_tqdm(*args, **kwargs)
    for n, batch, pooling, side in DDP_CASES:
        model, tokenizer = tiny_setup(side)
        rows = dna_rows(tokenizer, n)
        path = Path(out_dir) / f"ddp_{n}_{batch}_{pooling}_{side}.safetensors"
        result = embed_dataset(model, rows, batch_size=batch, pooling=pooling, tokenizer=tokenizer, output_file=path)
        # Inference needs no DDP wrapper (no gradients): the model stays a plain module on this rank's device.
        assert type(model).__name__ == "BertForMaskedLM" and next(model.parameters()).device.type == state.device.type
        if rank == 0:
            assert result.shape == (n, 32)
        else:
            assert result is None
        assert path.exists()  # every rank returns after the main process has finished the file
    assert bars == [rank != 0] * len(DDP_CASES)
    with pytest.raises(ValueError, match="DataParallel inside a multi-process launch"):
        embed_dataset(model, rows, tokenizer=tokenizer, data_parallel=True)
    # Same weights on both ranks (same seed): else "equal embeddings" would prove nothing about the gather.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])
    dist.barrier()
    dist.destroy_process_group()


def test_two_rank_ddp_equals_one_process(tmp_path):
    spawn_cpu_ranks(_ddp_worker, (str(tmp_path),), 2)
    for n, batch, pooling, side in DDP_CASES:
        model, tokenizer = tiny_setup(side)
        rows = dna_rows(tokenizer, n)
        ddp = load_file(tmp_path / f"ddp_{n}_{batch}_{pooling}_{side}.safetensors")["embeddings"]
        single = embed_dataset(model, rows, batch_size=batch, pooling=pooling, tokenizer=tokenizer, progress=False)
        assert ddp.shape == single.shape == (n, 32), (n, ddp.shape)
        np.testing.assert_allclose(ddp, single, atol=ATOL, rtol=0, err_msg=f"{n} rows, batch {batch}")
        np.testing.assert_allclose(ddp, one_by_one(model, rows, pooling), atol=ATOL, rtol=0)


# --- a rank that fails -----------------------------------------------------------------------------------------------

FAILING_ROWS = 13  # 4 steps of 2 rows x 2 ranks; rank 1's batch 1 holds rows 6..7


def _fail_at_call(module: torch.nn.Module, call: int) -> None:
    """Make `module`'s forward raise on its `call`-th call (0-based), as a model that breaks on some input would."""
    calls = []

    def hook(*_):
        calls.append(None)
        if len(calls) == call + 1:
            raise ValueError(f"injected failure at call {call}")

    module.register_forward_pre_hook(hook)


def _expect_failure(out_dir: Path, **kwargs) -> dict:
    """Run embed_dataset expecting it to raise on this rank; what it said, how long it took and what it left."""
    start = time.monotonic()
    try:
        embed_dataset(batch_size=2, progress=False, **kwargs)
    except RuntimeError as error:
        # The failed rank keeps its own exception (and traceback) as the cause.
        report = {"message": str(error), "seconds": time.monotonic() - start, "cause": repr(error.__cause__)}
    else:
        raise AssertionError("embed_dataset returned on this rank although a rank failed")
    dist.barrier()  # by now the main process has removed its partial file
    report["left"] = sorted(path.name for path in out_dir.rglob("*"))
    return report


def _failing_rank_worker(out_dir: str):
    state = PartialState(cpu=True)
    assert state.num_processes == 2 and dist.get_world_size() == 2
    assert state.distributed_type == DistributedType.MULTI_CPU
    rank, out = state.process_index, Path(out_dir) / "embeddings"  # the reports go beside it, not inside
    out.mkdir(exist_ok=True)
    model, tokenizer = tiny_setup()
    rows = dna_rows(tokenizer, FAILING_ROWS)
    common = dict(model=model, dataset=rows, tokenizer=tokenizer)
    reports, partial_seen = {}, []
    if rank == 0:
        (out / "blocker").write_text("a file, not a folder")  # for the writer's failure below
        # Rank 0's second batch runs after it wrote step 0: the partial file it must remove exists by then.
        partial = out / "forward.safetensors.partial"
        model.bert.encoder.register_forward_pre_hook(lambda *_: partial_seen.append(partial.exists()))
    else:
        # Rank 1's model raises in its second batch (step 1, rows 6..7).
        _fail_at_call(model.bert.encoder, 1)
    reports["forward"] = _expect_failure(out, output_file=out / "forward.safetensors", **common)
    assert partial_seen == ([False, True] if rank == 0 else []), partial_seen
    model, tokenizer = tiny_setup()
    common["model"] = model
    # Rank 0's writer fails (the output folder is a regular file); rank 1 learns it at the next step.
    reports["writer"] = _expect_failure(out, output_file=out / "blocker" / "e.npy", **common)
    # Both ranks fail in the same step: each names both.
    _fail_at_call(model.bert.encoder, 0)
    reports["both"] = _expect_failure(out, output_file=out / "both.npy", **common)
    for report in reports.values():
        assert report["seconds"] < 30, report
        assert report["left"] == ["blocker"], report  # no output file, partial or final
    (out.parent / f"rank{rank}.json").write_text(json.dumps(reports))
    # The group is still usable: a good run after the failures embeds every row.
    model, tokenizer = tiny_setup()
    result = embed_dataset(model, rows, batch_size=2, tokenizer=tokenizer, output_file=out / "ok.npy", progress=False)
    assert (result.shape == (FAILING_ROWS, 32)) if rank == 0 else result is None
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.full  # two processes, one failing, the other stopped by its deadline (~4 s): .ci/run's own step
def test_failing_rank_reaches_every_rank_within_seconds(tmp_path):
    start = time.monotonic()
    # Well under the default 300 s: a rank left waiting in a collective would run into this, not pass late.
    spawn_cpu_ranks(_failing_rank_worker, (str(tmp_path),), 2, timeout=90)
    assert time.monotonic() - start < 120
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    forward = (
        "embed_dataset failed on rank 1: ValueError: In the batch of dataset rows 6..7: injected failure at call 1"
    )
    blocker = str(tmp_path / "embeddings" / "blocker")
    writer = f"embed_dataset failed on rank 0: FileExistsError: [Errno 17] File exists: {blocker!r}"
    both = (
        "embed_dataset failed on rank 0: ValueError: In the batch of dataset rows 0..1: injected failure at call 0; "
        "rank 1: ValueError: In the batch of dataset rows 2..3: injected failure at call 0"
    )
    assert [report["forward"]["cause"] for report in reports] == [
        "None",
        "ValueError('In the batch of dataset rows 6..7: injected failure at call 1')",
    ]
    for rank, report in enumerate(reports):
        assert report["forward"]["message"] == forward, rank
        assert report["writer"]["message"] == writer, rank
        assert report["both"]["message"] == both, rank
    assert np.load(tmp_path / "embeddings" / "ok.npy").shape == (FAILING_ROWS, 32)
