"""
`hf-parallel config`: write an accelerate config for DDP (or DeepSpeed ZeRO) on this machine (or several like it)
and print the `accelerate launch` commands. The settings come from `hf_parallel.commands.config_plan`; this module
renders them as YAML, writes the file (every failure is one clear error) and adds the subcommand to the parser.

```bash
hf-parallel config -o ddp.yaml          # DDP over the GPUs found here (2 CPU processes on a machine without GPUs)
hf-parallel config --num-machines 2 --machine-rank 0 --main-process-ip 10.0.0.1 -o ddp.yaml
hf-parallel config --deepspeed 3 -o zero3.yaml   # DeepSpeed ZeRO-3 over the GPUs found here
```
"""

from __future__ import annotations

import argparse
import inspect
import shlex
import sys
from pathlib import Path

import yaml

from .config_plan import DEFAULT_PORT, MIXED_PRECISIONS, LaunchPlan, plan_config

__all__ = ["DEFAULT_OUTPUT", "add_parser", "launch_commands", "render_config", "write_config"]

DEFAULT_OUTPUT = "accelerate_config.yaml"


def render_config(plan: LaunchPlan) -> str:
    """The YAML text of a plan, with a header saying what it is and where it came from."""
    s = plan.settings
    what = "CPU processes (gloo)" if plan.uses_cpu else "GPUs, one process each (NCCL)"
    engine = "DDP" if plan.zero_stage is None else f"DeepSpeed ZeRO-{plan.zero_stage}"
    header = [
        "# Written by `hf-parallel config` (from hf_parallel/configs/" + plan.base + ".yaml).",
        f"# {engine} over {plan.processes_per_machine} x {what} on each of {s['num_machines']} machine(s): "
        f"{s['num_processes']} processes in all (accelerate's num_processes counts every machine).",
    ]
    if plan.zero_stage == 3:
        header.append(
            "# Save on every process (trainer.save_model, model.save_pretrained): each holds a slice of every "
            "parameter."
        )
    if plan.uses_cpu:
        header.append(
            "# accelerate does not pass use_cpu to the processes it starts: give the script --use_cpu "
            "(TrainingArguments(use_cpu=True)) or set ACCELERATE_USE_CPU=1 before `accelerate launch`."
        )
    if s["num_machines"] > 1:
        header.append(
            "# Copy this file to every machine; each overrides machine_rank on its command line (--machine_rank R)."
        )
    return "\n".join(header) + "\n" + yaml.safe_dump(s, sort_keys=False)


def launch_commands(plan: LaunchPlan, config_path: str, script: str) -> list[str]:
    """The `accelerate launch` command for each machine of the plan (one line per machine)."""
    script_args = " --use_cpu" if plan.uses_cpu else ""
    config = shlex.quote(config_path)
    n = plan.settings["num_machines"]
    # One machine needs no --machine_rank: the config's own (0) applies.
    ranks = [""] if n == 1 else [f" --machine_rank {rank}" for rank in range(n)]
    return [f"accelerate launch --config_file {config}{rank} {script}{script_args}" for rank in ranks]


def write_config(text: str, output: str, overwrite: bool = False) -> Path:
    """
    Write a config file, creating its folder; every way this can fail is a `ValueError` naming the path and the fix.

    Args:
        text (`str`):
            The file's content.
        output (`str`):
            The path to write.
        overwrite (`bool`, *optional*, defaults to `False`):
            Replace the file if it exists.
    """
    if not output:
        raise ValueError(f"-o needs a file path, got an empty one; e.g. -o {DEFAULT_OUTPUT}.")
    target = Path(output)
    if target.is_dir():
        raise ValueError(f"{target} is a directory; pass a file path to -o, e.g. -o {target / DEFAULT_OUTPUT}.")
    if target.exists() and not overwrite:
        raise ValueError(f"{target} already exists; pass --overwrite to replace it, or -o another file.")
    # The nearest existing folder above the file must be a folder: "mkdir" under a regular file fails with a bare
    # FileExistsError or NotADirectoryError that names neither the file nor the fix.
    existing = next(parent for parent in target.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise ValueError(
            f"cannot write {target}: {existing} is a file, not a directory; pass -o a path in a directory."
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ValueError(
            f"cannot write {target} ({reason}); pass -o a path in a directory you can write to."
        ) from None
    return target


def _run(args: argparse.Namespace) -> None:
    # Every option named after a parameter of plan_config is that parameter (num_gpus is counted, not an option).
    options = inspect.signature(plan_config).parameters.keys() & vars(args).keys()
    plan = plan_config(**{name: getattr(args, name) for name in options})
    text = render_config(plan)
    if args.output == "-":
        sys.stdout.write(text)
        path, report = DEFAULT_OUTPUT, sys.stderr
    else:
        path, report = str(write_config(text, args.output, args.overwrite)), sys.stdout
        print(f"Wrote {path}", file=report)
    commands = launch_commands(plan, path, args.script)
    if len(commands) == 1:
        print(f"Launch with:\n  {commands[0]}", file=report)
    else:
        print("Launch on every machine (machine 0 first is not required; they wait for each other):", file=report)
        for rank, command in enumerate(commands):
            print(f"  machine {rank}: {command}", file=report)
    if plan.uses_cpu:
        print(
            "  (--use_cpu is a TrainingArguments flag; a script without it needs ACCELERATE_USE_CPU=1 set instead)",
            file=report,
        )


def add_parser(subcommands, integer) -> argparse.ArgumentParser:
    """Add `config` to the parser's `subcommands` (`add_subparsers()`); `integer`: the type of whole-number options."""
    config = subcommands.add_parser(
        "config",
        help="write an accelerate config fit for this machine and print the `accelerate launch` command",
        description="Write an accelerate config for DDP over the GPUs of this machine (over CPU processes when it "
        "has none), or DeepSpeed ZeRO over its GPUs (--deepspeed), for one or several machines, and print the "
        "`accelerate launch` command to use.",
    )
    config.add_argument(
        "--num-processes",
        type=integer,
        default=None,
        help="processes on EACH machine (default: the GPUs visible here; 2 without GPUs). The file's num_processes "
        "is this times --num-machines, as accelerate counts all machines.",
    )
    config.add_argument("--num-machines", type=integer, default=1, help="machines taking part (default: 1)")
    config.add_argument(
        "--machine-rank", type=integer, default=0, help="this machine's index, 0 .. num-machines - 1 (default: 0)"
    )
    config.add_argument(
        "--main-process-ip", default=None, help="machine 0's address, reachable from every machine (several machines)"
    )
    config.add_argument(
        "--main-process-port",
        type=integer,
        default=None,
        help=f"machine 0's rendezvous port (default: {DEFAULT_PORT} for several machines; 0 = a free port picked at "
        "launch, on one machine)",
    )
    config.add_argument("--cpu", action="store_true", help="use CPU processes (gloo) even when GPUs are visible")
    config.add_argument("--gpu-ids", default=None, help="comma-separated GPUs to use, e.g. 0,1 (default: all)")
    config.add_argument("--mixed-precision", default="no", choices=MIXED_PRECISIONS, help="(default: no)")
    config.add_argument(
        "--deepspeed",
        type=integer,
        default=None,
        metavar="STAGE",
        help="DeepSpeed ZeRO stage 2 or 3 over the GPUs instead of DDP (needs GPUs and `pip install deepspeed`)",
    )
    config.add_argument(
        "-o",
        "--output",
        default=DEFAULT_OUTPUT,
        help=f"file to write (default: {DEFAULT_OUTPUT}); '-' prints the YAML on stdout",
    )
    config.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    config.add_argument(
        "--script", default="train.py", help="the training script to show in the printed command (default: train.py)"
    )
    config.set_defaults(run=_run)
    return config
