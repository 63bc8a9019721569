"""`hf-parallel config` and `hf-parallel env`, the accelerate configs shipped as package data, and the GPU count
`hf-parallel config` gets without torch.

GPU machines are simulated by patching the GPU count the command sees (or by a fake `nvidia-smi` on PATH); every
written config is loaded back with accelerate's own loader and checked against what `accelerate launch` will do with
it. User errors are also run as the console script runs them, in a fresh interpreter: one line, exit 2, no traceback.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from hf_parallel.commands import config_plan
from hf_parallel.commands import env as env_command
from hf_parallel.commands import gpus as gpu_count
from hf_parallel.commands.config_plan import (
    DEEPSPEED_CONFIGS,
    SHIPPED_CONFIGS,
    plan_config,
    shipped_config,
    shipped_config_text,
)
from hf_parallel.commands.env import trainer_mode
from hf_parallel.commands.main import main
from tests.helpers.paths import NO_GPUS, ROOT, repo_env


@pytest.fixture
def gpus(monkeypatch):
    """Make `hf-parallel` see the given number of GPUs (`config` counts them without torch, `env` with it)."""

    def set_count(n: int):
        monkeypatch.setattr(config_plan, "count_gpus", lambda: n)
        monkeypatch.setattr(env_command, "torch_gpu_count", lambda: n)

    return set_count


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


@pytest.mark.parametrize("stage", [2, 3], ids=lambda stage: f"deepspeed_zero{stage}.yaml")
def test_shipped_deepspeed_configs_load_in_accelerate(stage):
    """Each loads as a DeepSpeed launch of its ZeRO stage; ZeRO-3's saves whole weights (tests/launch runs it)."""
    name = f"deepspeed_zero{stage}"
    assert name in DEEPSPEED_CONFIGS
    path = ROOT / "hf_parallel" / "configs" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type == DistributedType.DEEPSPEED
    assert config.deepspeed_config["zero_stage"] == stage
    assert config.num_processes == 2 and config.use_cpu is False and config.main_process_port == 0
    # The Trainer's arguments fill DeepSpeed's "auto" values: the config sets none of them.
    assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(config.deepspeed_config)
    if stage == 3:
        assert config.deepspeed_config["zero3_save_16bit_model"] is True
        assert config.deepspeed_config["zero3_init_flag"] is True
    assert shipped_config_text(name) == path.read_text()


def test_config_deepspeed_over_the_gpus(gpus, tmp_path, capsys):
    gpus(4)
    config, text, printed = _config(tmp_path, capsys, "--deepspeed", "3")
    assert config.distributed_type == DistributedType.DEEPSPEED
    assert config.deepspeed_config["zero_stage"] == 3 and config.deepspeed_config["zero3_save_16bit_model"] is True
    assert config.num_processes == 4 and config.gpu_ids == "all"
    assert "from hf_parallel/configs/deepspeed_zero3.yaml" in text and "DeepSpeed ZeRO-3 over 4 x GPUs" in text
    assert "Save on every process" in text
    assert f"accelerate launch --config_file {tmp_path / 'config.yaml'} train.py" in printed
    # Several machines: each starts its processes through torchrun (accelerate's "standard"), not pdsh.
    (tmp_path / "config.yaml").unlink()
    argv = ["--deepspeed", "2", "--num-machines", "2", "--main-process-ip", "10.0.0.1"]
    config, text, _ = _config(tmp_path, capsys, *argv)
    assert config.distributed_type == DistributedType.DEEPSPEED and config.num_processes == 8
    assert config.deepspeed_config == {
        "zero_stage": 2,
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "deepspeed_multinode_launcher": "standard",
    }


@pytest.mark.parametrize(
    ("count", "argv", "message"),
    [
        (0, ["--deepspeed", "3"], "--deepspeed 3 needs GPUs (none is visible here)"),
        (4, ["--deepspeed", "2", "--cpu"], "--deepspeed 2 needs GPUs (--cpu was given)"),
        (4, ["--deepspeed", "1"], "--deepspeed takes the ZeRO stage, 2 or 3, got 1."),
    ],
)
def test_config_deepspeed_errors(gpus, tmp_path, capsys, count, argv, message):
    gpus(count)
    with pytest.raises(SystemExit) as exit_info:
        main(["config", *argv, "-o", str(tmp_path / "c.yaml")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c.yaml").exists()


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
        (["--num-machines", "0"], "--num-machines must be a whole number >= 1, got 0"),
        (["--machine-rank", "-1"], "--machine-rank must be a whole number >= 0, got -1"),
        (["--num-processes", "0"], "--num-processes must be a whole number >= 1, got 0"),
        (["--num-processes", "5"], "--num-processes 5 is more than the 4 GPUs available here"),
        (["--gpu-ids", "0,7"], "--gpu-ids '0,7' must name distinct GPUs among the 4 visible here"),
        (["--gpu-ids", "0,a"], "--gpu-ids must be comma-separated GPU indices"),
        (["--gpu-ids", "0,1", "--num-processes", "3"], "--num-processes 3 is more than the 2 GPUs available here"),
        (["--cpu", "--gpu-ids", "0,1"], "the config is for CPU processes (--cpu was given)"),
        (["--cpu", "--mixed-precision", "fp16"], "fp16 needs GPUs"),
        (["--main-process-port", "70000"], "TCP port in 0..65535, got 70000"),
        (["--main-process-port", "-1"], "--main-process-port must be a whole number >= 0, got -1"),
        (
            ["--num-machines", "2", "--main-process-ip", "10.0.0.1", "--main-process-port", "0"],
            "--main-process-port 0 (a port picked at launch) only works on one machine",
        ),
        (["--num-machines", "2", "--main-process-ip", "bad host!"], "neither an IP address nor a host name"),
        (["--num-machines", "2", "--main-process-ip", "node-.lan"], "'node-.lan' is neither an IP address nor a host"),
        (["--num-machines", "2", "--main-process-ip", "10.0.0.256"], "'10.0.0.256' is not a valid IP address"),
    ],
)
def test_config_errors_name_the_value_and_the_fix(gpus, tmp_path, capsys, argv, message):
    gpus(4)
    with pytest.raises(SystemExit) as exit_info:
        main(["config", *argv, "-o", str(tmp_path / "c.yaml")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("hf-parallel config: error: ")
    assert not (tmp_path / "c.yaml").exists()


def test_config_accepts_host_names_and_ipv6(gpus, tmp_path, capsys):
    gpus(1)
    for host in ("node-0.cluster.lan", "gpu01", "fd00::1"):
        config, _, _ = _config(tmp_path, capsys, "--num-machines", "2", "--main-process-ip", host)
        assert config.main_process_ip == host
        (tmp_path / "config.yaml").unlink()


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


def test_env_reports_even_if_accelerate_moves_its_default_config_name(gpus, no_launcher, capsys, monkeypatch):
    import accelerate.commands.config as accelerate_config

    gpus(0)
    monkeypatch.delattr(accelerate_config, "default_config_file")
    assert main(["env"]) == 0
    assert "accelerate default config: unknown (" in capsys.readouterr().out


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
    no_launcher.setattr(env_command, "_gpu_lines", lambda n: [])
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
        (["env", "--per-device-train-batch-size", "0"], "--per-device-train-batch-size must be a whole number >= 1"),
        (["env", "--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps must be a whole number >= 1"),
        (["env", "--num-processes", "0"], "--num-processes must be a whole number >= 1, got 0"),
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
    if not Path(script).exists():
        try:
            version = importlib.metadata.version("hf-parallel")
        except importlib.metadata.PackageNotFoundError:
            # Imported from a checkout without installing (the GPU check's machine): no console script to test.
            pytest.skip("hf_parallel is not installed (no distribution): the console script comes with pip install")
        raise AssertionError(f"hf-parallel {version} is installed without its console script: pip install -e .")
    path = tmp_path / "cpu.yaml"
    result = subprocess.run(
        [script, "config", "--cpu", "-o", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "accelerate launch --config_file" in result.stdout
    config = load_config_from_file(str(path))
    assert config.use_cpu is True and config.num_processes == 2


# ---- user errors, as the console script shows them ----


def _run_python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """
    Run `python ARGS` in a fresh interpreter that imports hf_parallel from this checkout, on a machine without GPUs:
    with GPUs, `config` writes another config (one GPU: a single process), and counts them with torch where the
    driver cannot (MIG, ROCm).
    """
    env = repo_env(**NO_GPUS)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120, check=False
    )


def _run_command(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run `python -m hf_parallel.commands.main ARGV`: what the console script runs."""
    return _run_python("-m", "hf_parallel.commands.main", *argv, cwd=cwd)


# (argv, what the one stderr line must contain): every kind of user error the CLI can meet. "{tmp}" is tmp_path,
# holding a regular file "file.txt" and a folder "folder".
USER_ERRORS = [
    (["config", "-o", "{tmp}/file.txt/cfg.yaml"], "{tmp}/file.txt is a file, not a directory"),
    (["config", "-o", "{tmp}/file.txt/sub/cfg.yaml"], "{tmp}/file.txt is a file, not a directory"),
    (["config", "-o", "{tmp}/folder"], "{tmp}/folder is a directory; pass a file path to -o"),
    (["config", "-o", "{tmp}/folder", "--overwrite"], "{tmp}/folder is a directory"),
    (["config", "-o", "{tmp}/file.txt"], "{tmp}/file.txt already exists; pass --overwrite"),
    (["config", "-o", ""], "-o needs a file path"),
    (["config", "--num-machines", "2", "--main-process-ip", "300.1.2.3"], "'300.1.2.3' is not a valid IP address"),
    (["config", "--num-machines", "2", "--main-process-ip", "no_such host"], "'no_such host' is neither an IP"),
    (["config", "--main-process-port", "65536"], "TCP port in 0..65535, got 65536"),
    (["config", "--main-process-port", "http"], "expected a whole number such as 2, got 'http'"),
    (["config", "--num-processes", "two"], "expected a whole number such as 2, got 'two'"),
    (["config", "--num-processes", "1.5"], "got '1.5'"),
    (["config", "--num-processes", "0"], "--num-processes must be a whole number >= 1, got 0"),
    (["config", "--cpu", "--mixed-precision", "fp8"], "invalid choice: 'fp8'"),
    (["config", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["deploy"], "invalid choice: 'deploy'"),
    (["env", "--gradient-accumulation-steps", "-2"], "--gradient-accumulation-steps must be a whole number >= 1"),
]


@pytest.mark.parametrize(("argv", "expected"), USER_ERRORS, ids=[" ".join(argv) for argv, _ in USER_ERRORS])
def test_user_errors_are_one_line_and_exit_2(tmp_path, argv, expected):
    (tmp_path / "file.txt").write_text("mine\n")
    (tmp_path / "folder").mkdir()
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    # --cpu: the outcome must not depend on the GPUs of the machine running the test.
    extra = ["--cpu"] if argv[0] == "config" and "--cpu" not in argv else []
    result = _run_command(*argv, *extra, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), result.stderr
    assert expected.format(tmp=tmp_path) in result.stderr
    # Nothing was written or changed.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file.txt", "folder"]
    assert (tmp_path / "file.txt").read_text() == "mine\n"


@pytest.mark.parametrize(
    ("variable", "value"), [("WORLD_SIZE", "two"), ("WORLD_SIZE", "0"), ("ACCELERATE_USE_CPU", "maybe")]
)
def test_env_names_a_bad_launcher_variable_in_one_line(no_launcher, capsys, variable, value):
    no_launcher.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["env"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"{variable}=" in err and value in err


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), OSError(30, "Read-only file system")])
def test_unwritable_output_is_one_line_naming_the_path(gpus, tmp_path, capsys, monkeypatch, error):
    # As root a chmod'ed folder stays writable, so the refusal the OS would give is raised by write_text.
    def refuse(self, *args, **kwargs):
        raise error

    gpus(0)
    monkeypatch.setattr(Path, "write_text", refuse)
    path = tmp_path / "locked" / "c.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "-o", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"cannot write {path} ({error.strerror}); pass -o a path in a directory you can write to." in err


# ---- no torch for --help and config ----

# Runs main(argv) in a fresh interpreter, then says which heavy modules were imported.
IMPORT_PROBE = """
import sys
from hf_parallel.commands.main import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit:
    status = exit.code
heavy = [name for name in ("torch", "transformers") if name in sys.modules]
print(f"exit {status}; imported: {','.join(heavy) or 'neither'}", file=sys.stderr)
"""


def _probe(tmp_path, *argv: str) -> str:
    return _run_python("-c", IMPORT_PROBE, *argv, cwd=tmp_path).stderr.splitlines()[-1]


@pytest.mark.parametrize("argv", [["--help"], ["config", "--help"], ["config", "-o", "{tmp}/out/ddp.yaml"]])
def test_help_and_config_import_neither_torch_nor_transformers(tmp_path, argv):
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    assert _probe(tmp_path, *argv) == "exit 0; imported: neither"
    if "-o" in argv:
        assert load_config_from_file(argv[-1]).distributed_type == DistributedType.MULTI_GPU


def test_env_imports_torch_so_the_probe_sees_it(tmp_path):
    # Control for the test above: the probe does see torch when a command imports it.
    assert _probe(tmp_path, "env").startswith("exit 0; imported: torch")


# ---- counting GPUs without torch ----


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("0", [0]),
        ("0,1, 2", [0, 1, 2]),
        ("2,0", [2, 0]),
        ("0,-1,1", [0]),
        ("-1", []),
        ("1gpu,3", [1, 3]),
        ("0,x,1", [0]),
        ("0,1,0", []),
        ("GPU-ab12,GPU-cd34", ["GPU-ab12", "GPU-cd34"]),
        ("GPU-ab12,1", ["GPU-ab12"]),
        ("MIG-ff00", ["MIG-ff00"]),
        ("GPU-ab,GPU-ab", []),
    ],
)
def test_parse_visible_devices_as_cuda_reads_it(value, expected):
    assert gpu_count.parse_visible_devices(value) == expected


UUIDS = ["GPU-aaaa-1111", "GPU-aaaa-2222", "GPU-bbbb-3333"]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, 3),
        ([], 0),
        ([1], 1),
        ([2, 0], 2),
        ([0, 3, 1], 1),
        ([5], 0),
        (["GPU-bbbb"], 1),
        (["GPU-aaaa-2", "GPU-b"], 2),
        (["GPU-aaaa", "GPU-b"], 0),
        (["GPU-b", "GPU-cccc"], 1),
        (["GPU-b", "GPU-bbbb-3"], 0),
        (["MIG-1234"], None),
    ],
)
def test_visible_gpu_count_follows_cuda(visible, expected):
    assert gpu_count.visible_gpu_count(visible, 3, UUIDS) == expected


def test_visible_gpu_count_without_uuids_leaves_uuid_lists_to_torch():
    assert gpu_count.visible_gpu_count(["GPU-aaaa"], 3, None) is None
    assert gpu_count.visible_gpu_count([0, 1], 3, None) == 2


@pytest.fixture
def driver(monkeypatch, tmp_path):
    """A machine whose NVIDIA driver, ROCm and proc entries are what the test says (none by default)."""
    cat = shutil.which("cat")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu_count, "PROC_GPUS", tmp_path / "proc-gpus")
    monkeypatch.setattr(gpu_count, "OTHER_GPU_DRIVERS", (tmp_path / "kfd",))

    def torch_must_not_count():
        raise AssertionError("torch was asked to count the GPUs")

    monkeypatch.setattr(gpu_count, "torch_gpu_count", torch_must_not_count)

    def nvidia_smi(output: str, status: int = 0):
        script = bin_dir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\n{cat} <<'END'\n{output}END\nexit {status}\n")
        script.chmod(0o755)

    return nvidia_smi


SMI_OUTPUT = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa-1111)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa-2222)
GPU 2: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbb-3333)
  MIG 3g.20gb     Device  0: (UUID: MIG-cccc-4444)
"""


def test_count_gpus_without_any_driver_is_zero(driver):
    assert gpu_count.count_gpus() == 0


def test_count_gpus_from_nvidia_smi(driver, monkeypatch):
    driver(SMI_OUTPUT)
    assert gpu_count.count_gpus() == 3
    assert gpu_count.count_gpus({"CUDA_VISIBLE_DEVICES": "2,0"}) == 2
    assert gpu_count.count_gpus({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}) == 1
    assert gpu_count.count_gpus({"CUDA_VISIBLE_DEVICES": "0,7,1"}) == 1
    assert gpu_count.count_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_count.count_gpus() == 1


def test_count_gpus_from_proc_without_nvidia_smi(driver, tmp_path):
    for address in ("0000:17:00.0", "0000:65:00.0"):
        (tmp_path / "proc-gpus" / address).mkdir(parents=True)
    assert gpu_count.count_gpus() == 2
    assert gpu_count.count_gpus({"CUDA_VISIBLE_DEVICES": "1,2"}) == 1


@pytest.mark.parametrize(
    ("setup", "visible"),
    [
        ("nvidia-smi fails", None),
        ("MIG instances", "MIG-cccc-4444"),
        ("UUIDs without nvidia-smi", "GPU-aaaa"),
        ("ROCm", None),
    ],
)
def test_count_gpus_asks_torch_only_where_the_driver_cannot_tell(driver, monkeypatch, tmp_path, setup, visible):
    if setup == "nvidia-smi fails":
        driver("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", status=9)
    elif setup == "MIG instances":
        driver(SMI_OUTPUT)
    elif setup == "UUIDs without nvidia-smi":
        (tmp_path / "proc-gpus" / "0000:17:00.0").mkdir(parents=True)
    else:
        (tmp_path / "kfd").touch()
    monkeypatch.setattr(gpu_count, "torch_gpu_count", lambda: 5)
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert gpu_count.count_gpus(environ) == 5


def test_config_plans_for_the_gpus_nvidia_smi_lists(driver, tmp_path, capsys):
    driver(SMI_OUTPUT)
    config, _, _ = _config(tmp_path, capsys)
    assert config.use_cpu is False and config.num_processes == 3 and config.gpu_ids == "all"


@pytest.mark.gpu
def test_env_reports_the_gpus_torch_sees(no_launcher, capsys):
    import torch

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    count = torch.cuda.device_count()
    assert f"GPUs visible: {count}" in out and f"cuda:0: {torch.cuda.get_device_name(0)}" in out
    assert "one process on cpu" not in out and ("on cuda:0" in out or "nn.DataParallel over" in out), out
