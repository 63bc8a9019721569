"""
The `hf-parallel` console script: `hf-parallel config` (`hf_parallel.commands.config`) writes an accelerate config
for this machine, `hf-parallel env` (`hf_parallel.commands.env`) reports the set-up.

Every user error (a bad option value, a path that cannot be written) ends the command with one line on stderr that
names the value and the fix, and exit status 2; never a traceback. `--help` and `config` import neither torch nor
transformers, so they answer at once.

```bash
hf-parallel --help
python -m hf_parallel.commands.main config -o ddp.yaml
```
"""

from __future__ import annotations

import argparse
import sys

from . import config, env

__all__ = ["build_parser", "main"]


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line naming the problem and where the options are explained."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`.\n")


def _whole_number(text: str) -> int:
    # argparse reports a ValueError from `type` as "invalid _whole_number value"; ArgumentTypeError's text is kept.
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number such as 2, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The `hf-parallel` argument parser, with one subparser per subcommand module."""
    parser = _OneLineParser(
        prog="hf-parallel",
        description="Launch helpers for hf_parallel: write an accelerate config for this machine, report the set-up.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="{config,env}")
    for module in (config, env):
        module.add_parser(subcommands, _whole_number)
    return parser


def main(argv: list[str] | None = None) -> int:
    """
    Entry point of the `hf-parallel` console script; returns the exit status.

    Args:
        argv (`list[str]`, *optional*):
            The arguments after the program name; defaults to `sys.argv[1:]`.

    ```python
    from hf_parallel.commands.main import main

    main(["config", "--cpu", "-o", "-"])  # prints the YAML of a 2-process CPU config, returns 0
    ```
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        args.run(args)
    except ValueError as error:
        message = " ".join(str(error).split())
        parser.exit(2, f"hf-parallel {args.command}: error: {message}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
