"""MaxText spells boolean flags `--check_dtype=true`; Click flags take no value, so such tokens are rewritten.

The rewriting is derived from the Click command itself: every boolean flag it declares (`is_flag` options, with
or without a `--no-x` secondary) accepts `--x=true|false|1|0|yes|no`, under each of its spellings.
"""

from __future__ import annotations

from typing import Iterable

import click

TRUE, FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no"})


def boolean_flags(command: click.Command) -> dict[str, tuple[str, str | None]]:
  """Every spelling of a boolean flag of `command` → (its `on` token, its `off` token or None without one)."""
  table: dict[str, tuple[str, str | None]] = {}
  for param in command.params:
    if not (isinstance(param, click.Option) and param.is_flag and param.is_bool_flag):
      continue
    on, off = param.opts[0], (param.secondary_opts[0] if param.secondary_opts else None)
    for opt in param.opts:
      table[opt] = (on, off)
    for opt in param.secondary_opts:
      table[opt] = (off, on)  # `--no-x=false` is `--x`
  return table


def normalize_argv(argv: Iterable[str], flags: dict[str, tuple[str, str | None]]) -> list[str]:
  """`--x=true` → `--x`; `--x=false` → `--no-x`, or (a flag without `--no-x`) drops `--x` given before it.

  Tokens after a bare `--`, and `--x=value` where `--x` is not one of `flags` or the value is not a boolean, are
  left for Click to judge.
  """
  out: list[str] = []
  argv = list(argv)
  for i, token in enumerate(argv):
    if token == "--":
      return out + argv[i:]
    name, sep, value = token.partition("=")
    if not (sep and name in flags and value.lower() in TRUE | FALSE):
      out.append(token)
      continue
    on, off = flags[name]
    if value.lower() in TRUE:
      out.append(on)
    elif off is not None:
      out.append(off)
    else:  # the flag's default is off: the last spelling wins, as it would with `--no-x`
      out = [t for t in out if flags.get(t.partition("=")[0], (None,))[0] != on]
  return out
