"""The `inspect_checkpoint` command: a lazy Click group; each subcommand lives in its own module.

Errors raised by the library (`inspect_tool.errors`, `quant.errors`) are turned into one line on stderr and
exit code 2 here, in one place. Commands return 1 for `--strict` findings (or disagreement), else 0.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys

import click

from inspect_tool import process_state
from inspect_tool.cli import flags

# The cyclic garbage collector's thresholds for the command's process: JAX's and Flax's imports and the model's
# abstract trace allocate millions of objects, most of them kept, and under Python's defaults (700, 10, 10) an
# export's start-up ran 435 collections for 0.30 s, three of them full; with these, 27 for 0.06 s.
GC_THRESHOLDS = (20_000, 20, 20)
# ... and in the command's own process (`entry_point`) what its module imported is frozen out of the collector's
# scans once imported (`gc.freeze`: kept for the process's life anyway): an export to gs:// spent 7% of its CPU in
# the collector with the thresholds alone (`perf`), and its exit took 0.6 s, 0.3 s frozen.
_freeze_imports = False


def _thaw() -> None:
  global _freeze_imports  # pylint: disable=global-statement
  _freeze_imports = False


process_state.declare(f"{__name__}:_freeze_imports", process_state.SETTING, lambda: _freeze_imports, _thaw)

_COMMANDS = {  # name: (module, attribute, the line the top-level help shows)
    "maxtext": ("inspect_tool.cli.listing_cmds", "maxtext",
                "List a MaxText model's parameters from key=value overrides (sharding and per-device memory with "
                "--devices/--topology)."),
    "orbax": ("inspect_tool.cli.listing_cmds", "orbax", "List an Orbax checkpoint's arrays (metadata only)."),
    "hf": ("inspect_tool.cli.listing_cmds", "hf", "List HF safetensors tensors (headers only)."),
    "diff": ("inspect_tool.cli.diff_cmd", "diff",
             "Compare a model config with an Orbax or HF checkpoint (metadata only)."),
    "forward": ("inspect_tool.cli.forward_cmd", "forward", "Run the model on tokens; print losses and predictions."),
    "rules": ("inspect_tool.cli.rules_cmd", "rules", "Report which Qwix rules match which ops and weights."),
    "export": ("inspect_tool.cli.export_cmd", "export",
               "Export an FP8 quantized checkpoint (Orbax or DeepSeek FP8 safetensors) and validate it."),
    "verify": ("inspect_tool.cli.verify_cmd", "verify",
               "Check an export against its export_manifest.json: every tensor's shape, dtype and sha256."),
    "import": ("inspect_tool.cli.import_cmd", "import_", "Import a Hugging Face DeepSeek release into MaxText."),
    "presets": ("inspect_tool.cli.discovery_cmds", "presets", "List the model presets (model_name=...)."),
    "keys": ("inspect_tool.cli.discovery_cmds", "keys", "List MaxText's keys: default and what each changes here."),
    "topologies": ("inspect_tool.cli.discovery_cmds", "topologies",
                   "List the slice names maxtext --topology takes, with their devices."),
}


class LazyGroup(click.Group):
  """Imports a subcommand's module only when that subcommand runs (keeps `--help` free of JAX).

  Each subcommand's MaxText-style boolean spellings (`--strict=false`) are rewritten for Click (`flags`).
  """

  def list_commands(self, ctx):
    return list(_COMMANDS)

  def get_command(self, ctx, cmd_name):
    if cmd_name not in _COMMANDS:
      return None
    module, attr, _ = _COMMANDS[cmd_name]
    command = getattr(importlib.import_module(module), attr)
    if _freeze_imports:
      gc.freeze()
    return command

  def resolve_command(self, ctx, args):
    if args and not args[0].startswith("-") and args[0] not in _COMMANDS and not ctx.resilient_parsing:
      raise click.exceptions.NoSuchCommand(args[0], possibilities=list(_COMMANDS), ctx=ctx)
    cmd_name, cmd, rest = super().resolve_command(ctx, args)
    if cmd is not None:
      rest = flags.normalize_argv(rest, flags.boolean_flags(cmd))
    return cmd_name, cmd, rest

  def format_commands(self, ctx, formatter):
    rows = [(name, help_text) for name, (_, _, help_text) in _COMMANDS.items()]
    with formatter.section("Commands"):
      formatter.write_dl(rows)


@click.group(cls=LazyGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExample:\n  inspect_checkpoint maxtext model_name=deepseek3-tiny mtp_num_layers=1 "
             "--summary\n\n"
             "\b\nShell completion (bash; zsh and fish: zsh_source, fish_source):\n"
             "  eval \"$(_INSPECT_CHECKPOINT_COMPLETE=bash_source inspect_checkpoint)\"")
@click.version_option(package_name="inspect-checkpoint", prog_name="inspect_checkpoint")
@click.pass_context
def cli(ctx):
  """See a DeepSeek MoE + MTP model: its parameters, checkpoints, quantization coverage and FP8 export.

  Model keys are MaxText's, given as key=value (model_name=deepseek3-671b mtp_num_layers=1); boolean flags also
  take MaxText's --flag=true / --flag=false. `inspect_checkpoint COMMAND --help` shows a command's options.
  """
  if ctx.invoked_subcommand is None:  # a bare `inspect_checkpoint`: the help, and success
    click.echo(ctx.get_help())


def normalize_argv(argv: list[str]) -> list[str]:
  """MaxText's `--flag=true|false` spellings of every command's boolean flags, rewritten for Click."""
  table = {}
  for name in _COMMANDS:
    table.update(flags.boolean_flags(cli.get_command(None, name)))
  return flags.normalize_argv(argv, table)


def _library_errors() -> tuple[type[BaseException], ...]:
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  kinds: list[type[BaseException]] = [errors.InspectError]
  if "quant.errors" in sys.modules:
    kinds.append(sys.modules["quant.errors"].QuantError)
  return tuple(kinds)


def main(argv: list[str] | None = None, *, fresh: bool = True) -> int:
  """Runs the command of `argv` (default: sys.argv) and returns its exit code; `fresh=False` (the process's own
  run, `entry_point`) keeps a stop signal that arrived before."""
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  from inspect_tool.output import stop  # pylint: disable=import-outside-toplevel

  argv = list(sys.argv[1:] if argv is None else argv)
  from inspect_tool.host import accelerator  # pylint: disable=import-outside-toplevel
  accelerator.round_like_a_cpu(argv)  # before JAX starts (a process's first command)
  if fresh:
    stop.clear()
  stop.install_handlers()
  errors.quiet_closed_event_loop()
  code = _run(argv)
  from inspect_tool.distributed import runtime  # pylint: disable=import-outside-toplevel
  runtime.finish()
  if fresh:  # an in-process run (tests, the Python API): it has ended, the watchdog must not end the process later,
    stop.run_ended()  # and the next command starts with the defaults and no cached bytes
    process_state.end_command()
  return code


def _run(argv: list[str]) -> int:
  """The command's exit code; a failure is one line on stderr and, in a multi-process job, is sent to the others."""
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  from inspect_tool.distributed import runtime  # pylint: disable=import-outside-toplevel
  from inspect_tool.output import stop  # pylint: disable=import-outside-toplevel

  try:
    code = cli.main(args=argv, prog_name="inspect_checkpoint", standalone_mode=False)
    stop.check()  # a stop signal whose exception was swallowed still fails the run
  except click.exceptions.Exit as e:
    return e.exit_code
  except click.UsageError as e:  # one line, like every other input error
    where = e.ctx.command_path if e.ctx is not None else "inspect_checkpoint"
    click.echo(f"error: {e.format_message()} (see '{where} --help')", err=True)
    return e.exit_code
  except click.ClickException as e:
    e.show()
    return e.exit_code
  except click.exceptions.Abort:
    click.echo("aborted; nothing was left half-written", err=True)
    runtime.abandon("interrupted")
    return 130
  except OSError as e:  # a write to stdout outside `options.echo` (Click's own output: --help, --version)
    from inspect_tool.output import stdout  # pylint: disable=import-outside-toplevel
    if not stdout.is_write_failure(e):
      raise
    click.echo(f"error: {stdout.failure(e)}", err=True)
    return 2
  except KeyboardInterrupt:  # SIGINT before our handlers were installed (the interpreter's own start-up)
    stop.report("interrupted by SIGINT; nothing was left half-written")
    runtime.abandon("interrupted by SIGINT")
    return 130
  except Exception as e:  # pylint: disable=broad-except
    if stop.received() is not None:  # the stop's exception, turned into another by C++ code (an import, a compile)
      signum = stop.received()
      stop.report(f"interrupted by {signal.Signals(signum).name}; nothing was left half-written")
      runtime.abandon("interrupted")
      return 128 + signum
    if isinstance(e, _library_errors()):
      click.echo(f"error: {e}", err=True)
      runtime.abandon(str(e))
      return getattr(e, "exit_code", 2)
    runtime.abandon(f"{type(e).__name__}: {str(e)[:200]}")
    raise
  except errors.Interrupted as e:
    sys.stderr.flush()
    stop.report(f"interrupted by {e}; nothing was left half-written")
    runtime.abandon(f"interrupted by {e}")
    return e.exit_code
  return code if isinstance(code, int) else 0


def entry_point() -> None:
  """The `inspect_checkpoint` process: `main`, its exit code, the last of stdout flushed."""
  global _freeze_imports  # pylint: disable=global-statement
  from inspect_tool.output import stop  # pylint: disable=import-outside-toplevel

  try:
    stop.install_handlers()  # before anything heavy is imported (again: `__main__.run` did it first)
    gc.set_threshold(*GC_THRESHOLDS)
    _freeze_imports = True
    code = main(fresh=False)
  except BaseException:  # a stop outside the command itself (setting up, finishing): its line, not a traceback
    if stop.received() is None:
      raise
    stop.report(f"interrupted by {signal.Signals(stop.received()).name}; nothing was left half-written")
    code = 128 + stop.received()
  from inspect_tool.output import stdout  # pylint: disable=import-outside-toplevel
  try:
    stdout.flush()  # the last buffered bytes can fail too (a full disk, a closed pipe): one line, not a traceback
  except stdout.errors.InputError as e:
    click.echo(f"error: {e}", err=True)
    code = 2
  stop.ignore_from_now()  # the run is over: a signal during the interpreter's teardown changes nothing
  if stop.received() is not None:  # stopped: no wait at exit for threads still blocked (a network read)
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)
