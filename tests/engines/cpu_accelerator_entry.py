"""
`python tests/engines/cpu_accelerator_entry.py SCRIPT ARGS...`: run SCRIPT as `__main__` with ARGS inside
`hf_parallel.testing.cpu_as_accelerator()`, so that a process `accelerate launch` started with a DeepSpeed config runs
DeepSpeed on a machine without GPUs (for tests only: on GPUs, launch SCRIPT itself).
"""

import runpy
import sys

from hf_parallel.testing import cpu_as_accelerator

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    with cpu_as_accelerator():
        runpy.run_path(sys.argv[0], run_name="__main__")
