"""
Testing DataParallel and DDP code without GPUs: torch's own `nn.DataParallel` on virtual CPU devices (`emulation`),
real DDP ranks spawned on CPU (`ranks`), and the CPU shown to accelerate as an accelerator, so that DeepSpeed runs
on those ranks (`accelerator`).
"""

from .accelerator import cpu_as_accelerator
from .emulation import Emulation, simulate_data_parallel, simulated_training_args
from .ranks import spawn_cpu_ranks

__all__ = ["Emulation", "cpu_as_accelerator", "simulate_data_parallel", "simulated_training_args", "spawn_cpu_ranks"]
