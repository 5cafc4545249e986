"""`python -m inspect_tool` runs the `inspect_checkpoint` command."""

from inspect_tool import cli

cli.entry_point()
