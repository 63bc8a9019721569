"""`hf-parallel config` and `hf-parallel env`, and the accelerate configs shipped as package data.

GPU machines are simulated by patching the GPU count the command sees; every written config is loaded back with
accelerate's own loader and checked against what `accelerate launch` will do with it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from hf_parallel import cli
from hf_parallel.cli import SHIPPED_CONFIGS, main, plan_config, shipped_config, shipped_config_text, trainer_mode

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpus(monkeypatch):
    """Make `hf-parallel` see the given number of GPUs."""

    def set_count(n: int):
        monkeypatch.setattr(cli, "_visible_gpus", lambda: n)

    return set_count


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _config(tmp_path, capsys, *argv) -> tuple[object, str, str]:
    """Run `hf-parallel config ... -o FILE`; return accelerate's view of FILE, its text and what was printed."""
    path = tmp_path / "config.yaml"
    assert main(["config", *argv, "-o", str(path)]) == 0
    return load_config_from_file(str(path)), path.read_text(), capsys.readouterr().out


# ---- the shipped configs ----


# ids not equal to a marker name: conftest skips items whose keywords include "multi_gpu".
@pytest.mark.parametrize("name", SHIPPED_CONFIGS, ids=lambda name: f"{name}.yaml")
def test_shipped_configs_load_in_accelerate(name):
    path = ROOT / "hf_parallel" / "configs" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type == DistributedType.MULTI_GPU
    assert config.num_processes >= 2
    # importlib.resources reads the same file as the one in the source tree.
    assert shipped_config_text(name) == path.read_text()
    assert shipped_config(name)["num_processes"] == config.num_processes


def test_shipped_configs_say_what_they_are_for():
    cpu, gpu, nodes = (shipped_config(name) for name in SHIPPED_CONFIGS)
    assert cpu["use_cpu"] is True and cpu["num_processes"] == 2 and cpu["num_machines"] == 1
    assert gpu["use_cpu"] is False and gpu["num_machines"] == 1 and gpu["gpu_ids"] == "all"
    assert nodes["num_machines"] == 2 and nodes["machine_rank"] == 0
    assert nodes["num_processes"] % nodes["num_machines"] == 0
    text = shipped_config_text("multi_node")
    for key in ("machine_rank", "main_process_ip", "main_process_port"):
        # Each multi-machine setting comes with a comment explaining it.
        line = text.splitlines().index(next(line for line in text.splitlines() if line.startswith(f"{key}:")))
        assert text.splitlines()[line - 1].startswith("#"), key


def test_unknown_shipped_config_is_named():
    with pytest.raises(ValueError, match="No shipped accelerate config named 'gpu'; the names are cpu_ddp"):
        shipped_config_text("gpu")


# ---- hf-parallel config ----


def test_config_without_gpus_writes_the_cpu_ddp_config(gpus, tmp_path, capsys):
    gpus(0)
    config, text, printed = _config(tmp_path, capsys)
    assert config.distributed_type == DistributedType.MULTI_GPU
    assert config.use_cpu is True
    assert config.num_processes == 2 and config.num_machines == 1
    assert config.main_process_port == 0
    assert "from hf_parallel/configs/cpu_ddp.yaml" in text
    assert f"accelerate launch --config_file {tmp_path / 'config.yaml'} train.py --use_cpu" in printed
    assert "ACCELERATE_USE_CPU=1" in printed


def test_config_with_gpus_runs_ddp_over_all_of_them(gpus, tmp_path, capsys):
    gpus(4)
    config, text, printed = _config(tmp_path, capsys, "--script", "examples/train.py")
    assert config.distributed_type == DistributedType.MULTI_GPU
    assert config.use_cpu is False
    assert config.num_processes == 4 and config.gpu_ids == "all"
    assert "from hf_parallel/configs/multi_gpu.yaml" in text
    assert printed.splitlines()[-1].strip() == (
        f"accelerate launch --config_file {tmp_path / 'config.yaml'} examples/train.py"
    )


def test_config_gpu_ids_and_process_count(gpus, tmp_path, capsys):
    gpus(4)
    config, _, _ = _config(tmp_path, capsys, "--gpu-ids", "1,3")
    assert config.gpu_ids == "1,3" and config.num_processes == 2
    (tmp_path / "config.yaml").unlink()
    config, _, _ = _config(tmp_path, capsys, "--num-processes", "3", "--mixed-precision", "bf16")
    assert config.num_processes == 3 and config.mixed_precision == "bf16"
    # --cpu on a GPU machine: CPU processes, no gpu_ids.
    (tmp_path / "config.yaml").unlink()
    config, _, _ = _config(tmp_path, capsys, "--cpu", "--num-processes", "4")
    assert config.use_cpu is True and config.num_processes == 4 and config.gpu_ids is None


def test_config_one_gpu_is_a_single_process(gpus, tmp_path, capsys):
    gpus(1)
    config, _, _ = _config(tmp_path, capsys)
    assert config.distributed_type == DistributedType.NO and config.num_processes == 1


def test_config_several_machines(gpus, tmp_path, capsys):
    gpus(8)
    argv = ["--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.1"]
    config, text, printed = _config(tmp_path, capsys, *argv)
    # accelerate counts the processes of all machines: 8 GPUs x 2 machines.
    assert config.num_processes == 16 and config.num_machines == 2 and config.machine_rank == 1
    assert config.main_process_ip == "10.0.0.1" and config.main_process_port == 29500
    assert config.same_network is True and config.rdzv_backend == "static"
    assert "from hf_parallel/configs/multi_node.yaml" in text and "16 processes in all" in text
    path = tmp_path / "config.yaml"
    assert f"machine 0: accelerate launch --config_file {path} --machine_rank 0 train.py" in printed
    assert f"machine 1: accelerate launch --config_file {path} --machine_rank 1 train.py" in printed


def test_config_to_stdout_is_valid_yaml_and_the_command_goes_to_stderr(gpus, capsys):
    gpus(0)
    assert main(["config", "-o", "-"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["use_cpu"] is True
    assert "accelerate launch --config_file accelerate_config.yaml train.py --use_cpu" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-machines", "2"], "--main-process-ip is required with --num-machines 2"),
        (["--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "h"], "--machine-rank must be in 0..1"),
        (["--num-machines", "0"], "--num-machines must be >= 1, got 0"),
        (["--num-processes", "0"], "--num-processes must be >= 1"),
        (["--num-processes", "5"], "--num-processes 5 is more than the 4 GPUs available here"),
        (["--gpu-ids", "0,7"], "--gpu-ids '0,7' must name distinct GPUs among the 4 visible here"),
        (["--gpu-ids", "0,a"], "--gpu-ids must be comma-separated GPU indices"),
        (["--gpu-ids", "0,1", "--num-processes", "3"], "--num-processes 3 is more than the 2 GPUs available here"),
        (["--cpu", "--gpu-ids", "0,1"], "the config is for CPU processes (--cpu was given)"),
        (["--cpu", "--mixed-precision", "fp16"], "fp16 needs GPUs"),
        (["--main-process-port", "70000"], "TCP port in 0..65535, got 70000"),
        (
            ["--num-machines", "2", "--main-process-ip", "10.0.0.1", "--main-process-port", "0"],
            "--main-process-port 0 (a port picked at launch) only works on one machine",
        ),
        (["--num-machines", "2", "--main-process-ip", "bad host!"], "neither an IP address nor a host name"),
    ],
)
def test_config_errors_name_the_value_and_the_fix(gpus, tmp_path, capsys, argv, message):
    gpus(4)
    with pytest.raises(SystemExit) as exit_info:
        main(["config", *argv, "-o", str(tmp_path / "c.yaml")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c.yaml").exists()


def test_config_refuses_to_overwrite_without_the_flag(gpus, tmp_path, capsys):
    gpus(0)
    path = tmp_path / "c.yaml"
    path.write_text("mine\n")
    with pytest.raises(SystemExit):
        main(["config", "-o", str(path)])
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert path.read_text() == "mine\n"
    assert main(["config", "-o", str(path), "--overwrite"]) == 0
    assert load_config_from_file(str(path)).use_cpu is True


def test_plan_config_is_usable_from_python():
    plan = plan_config(num_processes=2, cpu=True, num_gpus=0)
    assert plan.settings["distributed_type"] == "MULTI_GPU" and plan.settings["num_processes"] == 2
    assert plan.uses_cpu and plan.base == "cpu_ddp"


# ---- hf-parallel env ----


def test_env_reports_versions_backends_mode_and_global_batch(gpus, no_launcher, capsys):
    import accelerate
    import torch
    import transformers

    gpus(0)
    assert main(["env", "--per-device-train-batch-size", "16", "--gradient-accumulation-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"torch: {torch.__version__}" in out
    assert f"transformers: {transformers.__version__}" in out
    assert f"accelerate: {accelerate.__version__}" in out
    assert "GPUs visible: 0" in out
    assert "CUDA_VISIBLE_DEVICES: " in out
    gloo = "yes" if torch.distributed.is_gloo_available() else "no"
    assert f"gloo={gloo}" in out and "nccl=" in out and "mpi=" in out
    assert "Launcher variables: none (no launcher)" in out
    assert "hf_parallel.Trainer mode: single" in out
    assert "Effective global batch (rows per optimizer step): 32" in out


def test_env_under_a_cpu_launch_reports_ddp(gpus, no_launcher, capsys):
    gpus(0)
    no_launcher.setenv("WORLD_SIZE", "2")
    no_launcher.setenv("ACCELERATE_USE_CPU", "true")
    assert main(["env", "--per-device-train-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "WORLD_SIZE=2" in out and "ACCELERATE_USE_CPU=true" in out
    assert "mode: DDP: DDP over 2 CPU processes (gloo)" in out
    assert "Effective global batch (rows per optimizer step): 16" in out


def test_env_under_a_mislaunch_reports_the_error(gpus, no_launcher, capsys):
    gpus(0)
    no_launcher.setenv("WORLD_SIZE", "2")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "mode: error" in out and "--use_cpu" in out
    assert "Effective global batch" not in out


def test_env_with_gpus_predicts_data_parallel_or_ddp(gpus, no_launcher, capsys):
    gpus(4)
    # torch.cuda.get_device_properties needs real GPUs; this test only needs the mode, so drop the device lines.
    no_launcher.setattr(cli, "_gpu_lines", lambda n: [])
    assert main(["env", "--per-device-train-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "mode: DataParallel" in out and "accelerate launch --num_processes 4" in out
    assert "Effective global batch (rows per optimizer step): 32" in out
    assert main(["env", "--per-device-train-batch-size", "8", "--num-processes", "4"]) == 0
    out = capsys.readouterr().out
    assert "(as if launched with 4 processes): DDP" in out
    assert "Effective global batch (rows per optimizer step): 32" in out


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(num_gpus=0, world_size=1, use_cpu=False), ("single", 8)),
        (dict(num_gpus=1, world_size=1, use_cpu=False), ("single", 8)),
        (dict(num_gpus=4, world_size=1, use_cpu=True), ("single", 8)),
        (dict(num_gpus=4, world_size=1, use_cpu=False), ("DataParallel", 32)),
        (dict(num_gpus=4, world_size=4, use_cpu=False), ("DDP", 32)),
        (dict(num_gpus=0, world_size=2, use_cpu=True), ("DDP", 16)),
        (dict(num_gpus=0, world_size=2, use_cpu=False), ("error", 0)),
    ],
)
def test_trainer_mode_table(kwargs, expected):
    mode, batch, _ = trainer_mode(per_device_batch=8, grad_accum=1, **kwargs)
    assert (mode, batch) == expected


def test_trainer_mode_matches_the_training_arguments_here(no_launcher, tmp_path):
    from hf_parallel import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3)
    mode, batch, _ = trainer_mode(args.n_gpu, args.world_size, False, 4, 3)
    expected = {"not_parallel": "single", "not_distributed": "DataParallel"}[args.parallel_mode.value]
    assert mode == expected
    assert batch == args.train_batch_size * args.gradient_accumulation_steps * args.world_size


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["env", "--per-device-train-batch-size", "0"], "--per-device-train-batch-size must be >= 1, got 0"),
        (["env", "--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps must be >= 1, got 0"),
        (["env", "--num-processes", "0"], "--num-processes must be >= 1, got 0"),
    ],
)
def test_env_errors(no_launcher, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ---- --help and the console script ----


@pytest.mark.parametrize("argv", [["--help"], ["config", "--help"], ["env", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-parallel")
    if argv[0] == "config":
        assert "--num-processes" in out and "--main-process-ip" in out and "--output" in out
    if argv[0] == "env":
        assert "--per-device-train-batch-size" in out and "--gradient-accumulation-steps" in out


def test_no_subcommand_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "{config,env}" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_writes_a_config_accelerate_loads(tmp_path):
    script = shutil.which("hf-parallel") or str(Path(sys.executable).with_name("hf-parallel"))
    assert Path(script).exists(), "the hf-parallel console script is not installed: pip install -e ."
    path = tmp_path / "cpu.yaml"
    result = subprocess.run(
        [script, "config", "--cpu", "-o", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "accelerate launch --config_file" in result.stdout
    config = load_config_from_file(str(path))
    assert config.use_cpu is True and config.num_processes == 2
