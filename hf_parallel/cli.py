"""The former home of the `hf-parallel` command, kept so that `hf_parallel.cli:main` and its names keep working."""

import sys

from .commands.config import launch_commands, render_config
from .commands.config_plan import (
    SHIPPED_CONFIGS,
    LaunchPlan,
    plan_config,
    shipped_config,
    shipped_config_text,
)
from .commands.env import env_report, trainer_mode
from .commands.main import main

__all__ = ["SHIPPED_CONFIGS", "LaunchPlan", "env_report", "launch_commands", "main", "plan_config", "render_config"]
__all__ += ["shipped_config", "shipped_config_text", "trainer_mode"]

if __name__ == "__main__":
    sys.exit(main())
