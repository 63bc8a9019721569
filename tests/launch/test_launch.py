"""Real launches on CPU: the shipped CPU config runs examples/train.py as 2-process DDP, two "machines" on loopback
form one process group, and a mis-launch (torchrun without use_cpu) stops with a clear error where stock trains
unsynchronised copies. Each launch takes 10-20 s on 2 cores, so each checks many things.

Topology is read from the launched processes' own logs: `TORCH_DISTRIBUTED_DEBUG=INFO` makes every DDP wrapper log
"[Rank r]: DDP Initialized with: ... world_size ... backend_name ...", and `--log_level_replica info` makes every
rank log its batch sizes. The final weights are compared with a single process trained on the same global batch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertForSequenceClassification

from hf_parallel.commands.main import main as cli_main
from tests.helpers.paths import NO_GPUS, ROOT, repo_env
from tests.helpers.processes import Finished, free_port, run_together

TRAIN = ROOT / "examples" / "train.py"
CPU_CONFIG = ROOT / "hf_parallel" / "configs" / "cpu_ddp.yaml"
ZERO3_CONFIG = ROOT / "hf_parallel" / "configs" / "deepspeed_zero3.yaml"
CPU_ACCELERATOR_ENTRY = ROOT / "tests" / "engines" / "cpu_accelerator_entry.py"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
PER_RANK_BATCH = 8
LAUNCH_TIMEOUT_S = 300
DDP_LOG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "INFO", "TORCH_CPP_LOG_LEVEL": "INFO"}


def _train_flags(model_dir: Path, output_dir: Path, batch: int) -> list[str]:
    # The model comes from a folder (dropout 0, fixed init) so every run starts from the same weights and no
    # per-rank dropout mask separates 2 x B rows from 1 x 2B rows.
    return [
        "--model_name_or_path", str(model_dir),
        "--output_dir", str(output_dir),
        "--per_device_train_batch_size", str(batch),
        "--max_steps", "3",
        # Plain SGD: the update is proportional to the gradient, so a gradient off by x2 (stock transformers under
        # DDP) shows in the weights. AdamW would hide it, being invariant to the gradient's scale.
        "--optim", "sgd",
        "--learning_rate", "0.5",
        "--seed", "0",
        "--eval_strategy", "no",
        "--logging_steps", "1",
        "--disable_tqdm", "True",
        "--dataloader_pin_memory", "False",
        "--log_level", "info",
        "--log_level_replica", "info",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    # CPU launches on any machine: where GPUs are visible, the mis-launch's torchrun ranks would form an NCCL group,
    # leaving no mis-launch to catch.
    env = repo_env(**DDP_LOG_ENV, **NO_GPUS)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    return env


def _run(commands: list[list[str]], cwd: Path) -> tuple[list[Finished], float]:
    """Start the commands together and wait for all; any failure or hang raises with every process's output."""
    return run_together(commands, cwd, _env(), deadline_s=LAUNCH_TIMEOUT_S)


def _ddp_inits(log: str) -> dict[int, dict[str, str]]:
    """The `DDP Initialized with:` blocks torch logs per rank (TORCH_DISTRIBUTED_DEBUG=INFO), keyed by rank."""
    blocks = {}
    for match in re.finditer(r"\[Rank (\d+)\]: DDP Initialized with: *\n((?:[a-z_]+: .*\n)+)", log):
        fields = dict(line.split(": ", 1) for line in match.group(2).splitlines())
        blocks[int(match.group(1))] = fields
    return blocks


def _assert_ddp_topology(log: str, world_size: int, batch: int) -> None:
    inits = _ddp_inits(log)
    assert sorted(inits) == list(range(world_size)), f"DDP wrappers per rank: {sorted(inits)}\n{log[-3000:]}"
    for rank, fields in inits.items():
        assert fields["world_size"] == str(world_size), (rank, fields)
        assert fields["backend_name"] == "gloo", (rank, fields)
        assert fields["module_name"] == "BertForSequenceClassification", (rank, fields)
    # Every rank logs its own batch and the global one (--log_level_replica info).
    assert log.count(f"Instantaneous batch size per device = {batch}") == world_size
    assert log.count(f"Total train batch size (w. parallel, distributed & accumulation) = {batch * world_size}") == (
        world_size
    )
    # 320 rows sharded over the ranks: 320 / (batch x world_size) steps per epoch on each, not 320 / batch.
    assert log.count(f"Num update steps per epoch = {320 // (batch * world_size)}") == world_size


def _logged_losses(log: str) -> list[str]:
    """The training losses the Trainer printed (`{'loss': '0.6932', ...}`, 4 significant digits)."""
    return re.findall(r"\{'loss': '([^']+)'", log)


def _max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """examples/train.py's tiny BERT and word tokenizer, saved with dropout 0 so runs are comparable."""
    from examples.train import tiny_config, word_tokenizer

    path = tmp_path_factory.mktemp("init")
    tokenizer = word_tokenizer()
    config = tiny_config(tokenizer, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def single_process_run(model_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """
    The reference: examples/train.py's main() in this process, on the CPU as the launched ranks (with GPUs, it would
    train on GPU 0, or under DataParallel with a larger global batch), with the global batch 2 x PER_RANK_BATCH.
    """
    from accelerate.state import AcceleratorState, PartialState

    from examples.train import main as train_main

    out = tmp_path_factory.mktemp("single")
    saved_env = dict(os.environ)
    start = time.perf_counter()
    try:
        argv = ["train.py", *_train_flags(model_dir, out, 2 * PER_RANK_BATCH), "--use_cpu"]
        with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(io.StringIO()) as printed:
            train_main()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
    print(f"single-process examples/train.py (in-process): {time.perf_counter() - start:.1f} s")
    assert _max_weight_diff(out, model_dir) > 1e-3, "the reference did not train"
    losses = _logged_losses(printed.getvalue())
    assert len(losses) == 3
    return out, losses


@pytest.mark.full  # accelerate launch of two processes (~8 s): .ci/run runs it in its own step
def test_shipped_cpu_config_runs_ddp_equal_to_one_process(model_dir, single_process_run, tmp_path):
    out = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
        str(TRAIN), *_train_flags(model_dir, out, PER_RANK_BATCH), "--use_cpu",
    ]  # fmt: skip
    (result,), wall = _run([command], ROOT)
    print(f"accelerate launch --config_file cpu_ddp.yaml examples/train.py (2 processes): {wall:.1f} s")
    _assert_ddp_topology(result.output, world_size=2, batch=PER_RANK_BATCH)
    # examples/train.py's own check: the saved model reloads with from_pretrained and gives the same logits.
    assert "Reload check: from_pretrained gives the same logits" in result.output
    # 2 ranks x 8 rows == 1 process x 16 rows, step by step: the logged loss and the weights (this needs the exact
    # DDP loss: stock transformers logs x2 here, and its x2 gradient moves the weights by ~2e-2 more).
    reference, reference_losses = single_process_run
    assert _logged_losses(result.output) == reference_losses
    assert _max_weight_diff(out, reference) < 1e-5


@pytest.mark.slow
@pytest.mark.full  # two DeepSpeed processes launched for real (~14 s): .ci/run runs it in its own step
@pytest.mark.skipif(not HAS_DEEPSPEED, reason='deepspeed is not installed: pip install -e ".[deepspeed]"')
def test_shipped_deepspeed_zero3_config_trains_equal_to_one_process(model_dir, single_process_run, tmp_path):
    """
    `accelerate launch --config_file deepspeed_zero3.yaml examples/train.py`, each launched process entering
    `cpu_as_accelerator` first (tests/engines/cpu_accelerator_entry.py; on GPUs the script is launched itself): 2
    processes under ZeRO-3 train as one process on both ranks' rows, the saved model is whole (the example's reload
    check, run on every process, compares its logits with the partitioned model's).
    """
    out = tmp_path / "zero3"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3_CONFIG),
        str(CPU_ACCELERATOR_ENTRY), str(TRAIN), *_train_flags(model_dir, out, PER_RANK_BATCH),
    ]  # fmt: skip
    (result,), wall = _run([command], ROOT)
    print(f"accelerate launch --config_file deepspeed_zero3.yaml examples/train.py (2 processes): {wall:.1f} s")
    log = result.output
    assert log.count("Detected DeepSpeed ZeRO-3: activating zero.init() for this model") >= 2, log[-3000:]
    assert log.count(f"Instantaneous batch size per device = {PER_RANK_BATCH}") == 2
    assert log.count(f"Total train batch size (w. parallel, distributed & accumulation) = {2 * PER_RANK_BATCH}") == 2
    assert "Reload check: from_pretrained gives the same logits" in log
    reference, reference_losses = single_process_run
    assert _logged_losses(log) == reference_losses
    # Compared as from_pretrained loads them: under ZeRO-3 transformers 5.25 writes BERT's LayerNorm parameters under
    # their legacy names (gamma, beta), which it maps back when loading.
    ours, theirs = (BertForSequenceClassification.from_pretrained(path).state_dict() for path in (out, reference))
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5


@pytest.mark.full  # two launches of two processes (~15 s): .ci/run runs it in its own step
def test_two_machines_on_loopback_form_one_group(model_dir, single_process_run, tmp_path, capsys):
    # The config comes from `hf-parallel config`, as a user on a cluster would write it; machine 1 overrides the rank.
    config = tmp_path / "two_machines.yaml"
    port = free_port()
    argv = ["config", "--num-machines", "2", "--num-processes", "1", "--main-process-ip", "127.0.0.1"]
    assert cli_main([*argv, "--main-process-port", str(port), "--cpu", "-o", str(config)]) == 0
    printed = capsys.readouterr().out
    assert f"--config_file {config} --machine_rank 1 train.py --use_cpu" in printed
    out = tmp_path / "ddp"
    commands = [
        [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--machine_rank", str(rank), str(TRAIN), *_train_flags(model_dir, out, PER_RANK_BATCH), "--use_cpu",
        ]
        for rank in (0, 1)
    ]  # fmt: skip
    results, wall = _run(commands, ROOT)
    print(f"two machines on loopback (2 launches x 1 process, run together): {wall:.1f} s")
    # Each launch holds one rank of the same group: rank 0 on machine 0, rank 1 on machine 1.
    assert sorted(_ddp_inits(results[0].output)) == [0]
    assert sorted(_ddp_inits(results[1].output)) == [1]
    _assert_ddp_topology(results[0].output + results[1].output, world_size=2, batch=PER_RANK_BATCH)
    assert f"master_port: {port}" in results[1].output
    # Only the global rank 0 (machine 0) saves and runs the reload check.
    assert "Reload check" in results[0].output and "Reload check" not in results[1].output
    # Each machine's local process 0 prints the logged loss: both print the global one.
    reference, reference_losses = single_process_run
    assert _logged_losses(results[0].output) == reference_losses
    assert _logged_losses(results[1].output) == reference_losses
    # Only rank 0's weights reach the disk (transformers 5.24 writes weights on global rank 0 only, even with
    # save_on_each_node); rank 1 logged the same global losses at every step.
    assert _max_weight_diff(out, reference) < 1e-5


@pytest.mark.full  # torchrun twice, stock's and ours (~11 s): .ci/run runs it in its own step
def test_mislaunch_without_use_cpu_stops_where_stock_trains_unsynchronised_copies(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(ROOT / "tests" / "distributed" / "mislaunch_worker.py"), str(tmp_path),
    ]  # fmt: skip
    (result,), wall = _run([command], ROOT)
    print(f"torchrun --nproc_per_node 2 mislaunch_worker.py: {wall:.1f} s")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["env_world_size"] == 2
        # The trap, with stock transformers: a 2-rank process group exists, the Trainer ignores it and trains alone.
        assert report["process_group_world_size"] == 2
        assert report["stock_world_size"] == 1
        assert report["stock_parallel_mode"] == "not_parallel"
        assert report["stock_trained_steps"] == 3
        assert report["stock_wrapped_in_ddp"] is False
        # No gradient was exchanged: the copies drifted apart.
        assert report["stock_max_param_diff_across_ranks"] > 1e-3
        # hf_parallel: a clear error before training, naming the launch and the fix.
        error = report["hf_parallel_error"]
        assert error is not None
        assert "A launcher started 2 processes (WORLD_SIZE=2)" in error
        assert "world_size=1" in error and "--use_cpu" in error
