"""
The `hf-parallel` command, one module per subcommand: `main` (the console script and its argument parser),
`config` (write an accelerate config), `config_plan` (the settings it writes), `env` (report the set-up) and
`gpus` (count the GPUs without torch).
"""
