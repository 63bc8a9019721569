"""
Testing DataParallel and DDP code without GPUs: torch's own `nn.DataParallel` on virtual CPU devices (`emulation`)
and real DDP ranks spawned on CPU (`ranks`).
"""

from .emulation import Emulation, simulate_data_parallel, simulated_training_args
from .ranks import spawn_cpu_ranks

__all__ = ["Emulation", "simulate_data_parallel", "simulated_training_args", "spawn_cpu_ranks"]
