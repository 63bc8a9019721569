"""
Testing DataParallel and DDP code without GPUs: a CPU simulation of `nn.DataParallel` (`simulation`, over the
device work of `cpu_transport`) and real DDP ranks spawned on CPU (`ranks`).
"""

from .cpu_transport import CpuTransport, simulated_gather, simulated_scatter, simulated_scatter_kwargs
from .ranks import spawn_cpu_ranks
from .simulation import (
    SimulatedBalancedDataParallel,
    SimulatedDataParallel,
    simulate_data_parallel,
    simulated_training_args,
)

__all__ = [
    "CpuTransport",
    "SimulatedBalancedDataParallel",
    "SimulatedDataParallel",
    "simulate_data_parallel",
    "simulated_gather",
    "simulated_scatter",
    "simulated_scatter_kwargs",
    "simulated_training_args",
    "spawn_cpu_ranks",
]
