"""Options shared by the commands, and the one place that writes a report to stdout or files."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

import click

FORMATS = ("text", "json", "markdown")


def example(command: str) -> str:
  """A command's help epilog: one example, kept on one line (Click does not rewrap a `\\b` paragraph)."""
  return f"\b\nExample:\n  inspect_checkpoint {command}"


def complete_overrides(ctx, param, incomplete):  # pylint: disable=unused-argument
  """Shell completion of `model_name=`: the preset names (bash splits the word at `=`, zsh and fish do not)."""
  from inspect_tool.configuration import presets  # pylint: disable=import-outside-toplevel

  given = list(ctx.params.get(param.name) or ())
  if given[-2:] == ["model_name", "="] or given[-1:] == ["model_name="]:
    return [n for n in presets.names() if n.startswith(incomplete)]
  key, sep, value = incomplete.partition("=")
  if sep and key == "model_name":
    return [f"model_name={n}" for n in presets.names() if n.startswith(value)]
  return []


def overrides_argument(func):
  """The MaxText `key=value` arguments of a command that builds a model."""
  return click.argument("overrides", nargs=-1, shell_complete=complete_overrides)(func)


class OutputPath(click.Path):
  """A single output file (refused when it exists, unless --overwrite): `--output_file`, `--html`, `--save-logits`."""

  def __init__(self):
    super().__init__(dir_okay=False)


class OutputDirectory(click.Path):
  """The directory an export or import writes (`--output`): claimed by `output.destination.claim`."""


class InputPath(click.Path):
  """A path the command reads (`role`: what it is, in the line that refuses an output on or inside it)."""

  def __init__(self, role: str, **kwargs):
    super().__init__(**kwargs)
    self.role = role


def output_options(func):
  """--format, --check_dtype, --output_file, --html, --summary for every listing command."""
  options = [
      click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
                   help="Output format on stdout."),
      click.option("--check-dtype/--no-check-dtype", "--check_dtype", "check_dtype", default=False,
                   help="Show dtypes (MaxText spelling --check_dtype=true works too)."),
      click.option("--output-file", "--output_file", "output_file", type=OutputPath(),
                   help="Also write MaxText's listing (with a '# <command>' header) to this file, atomically."),
      click.option("--html", "html_file", type=OutputPath(),
                   help="Write a self-contained treescope HTML page of the tree to this file."),
      click.option("--summary/--no-summary", default=False,
                   help="With text format, add the summary by group (always in json/markdown)."),
      overwrite_option,
  ]
  for option in reversed(options):
    func = option(func)
  return func


def listing_options(func):
  """--filter and --collapse for the listing commands (maxtext, orbax, hf)."""
  options = [
      click.option("--filter", "key_filter", metavar="REGEX",
                   help="List only arrays whose dotted key (as printed) contains a match of REGEX; totals and "
                   "summary then describe what is shown and say so."),
      click.option("--collapse/--no-collapse", default=False,
                   help="One line per stack of repeated layers or experts (layers_{1..60}, experts.{0..255}): "
                   "count, shape each, total."),
  ]
  for option in reversed(options):
    func = option(func)
  return func


def listing_view(report, *, collapse: bool):
  """The report as `--collapse` shows it."""
  return dataclasses.replace(report, collapse=collapse)


def report_options(formats=("text", "json"), html: str | None = None, overwrite: bool = True):
  """--format, --output_file (the report as printed, also to a file), --html FILE when `html` says what the page
  shows, and --overwrite (unless the command has its own), for every command that reports."""
  def decorate(func):
    options = [
        click.option("--format", "fmt", type=click.Choice(formats), default="text", show_default=True,
                     help="Output format on stdout."),
        click.option("--output-file", "--output_file", "output_file", type=OutputPath(),
                     help="Also write the report, as printed, to this file, atomically."),
    ]
    if html:
      options.append(click.option("--html", "html_file", type=OutputPath(),
                                  help=f"Write a self-contained treescope HTML page ({html}) to this file."))
    if overwrite:
      options.append(overwrite_option)
    for option in reversed(options):
      func = option(func)
    return func
  return decorate


CHIP_HELP = ("Say how each group's quantized matmuls run on this chip's matrix units (v4, v5e, v5p, v6e, tpu7x, "
             "h100, h200, b200): natively and how fast against bf16, or widened to bf16; and which MaxText mode runs "
             "faster there.")
chip_option = click.option("--chip", help=CHIP_HELP)


def chip_options(func):
  """--topology and --chip of `rules`: the chip whose matrix units the verdicts at a glance are about."""
  func = chip_option(func)
  return click.option("--topology", help="A MaxText slice name (v5p-512, v6e-64, a3, ...) or a chip's name: as "
                      "--chip, for that slice's chip.")(func)


def chip_of(topology: str | None, chip: str | None) -> str | None:
  """The chip `--chip` names, else `--topology`'s (None: neither given); both given, they must agree (exit 2)."""
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  from inspect_tool.sharding import matrix_units  # pylint: disable=import-outside-toplevel
  from inspect_tool.sharding import mesh  # pylint: disable=import-outside-toplevel

  of_topology = mesh.topology_chip(topology).name if topology is not None else None
  if chip is not None:
    matrix_units.chip(chip)
    if of_topology is not None and of_topology != chip:
      raise errors.InputError(f"--chip {chip} disagrees with --topology {topology} (a {of_topology} slice); give "
                              "one of them, or both agreeing")
    return chip
  return of_topology


def remember_overwrite(ctx, param, value):  # pylint: disable=unused-argument
  """Records --overwrite for `check_output_files` (also the callback of a command's own --overwrite)."""
  ctx.meta["inspect_checkpoint.overwrite"] = bool(value)
  return value


def output_file_names(command: click.Command) -> list[str]:
  """The options of `command` that name a single output file (`OutputPath`), as spelled first."""
  return [p.opts[0] for p in command.params if isinstance(p, click.Option) and isinstance(p.type, OutputPath)]


class _OverwriteOption(click.Option):
  """`--overwrite`, whose help names the output options of the command it belongs to (and no others)."""

  def get_help_record(self, ctx):
    names = output_file_names(ctx.command) if ctx is not None else []
    self.help = f"Replace existing output files ({', '.join(names)}); without it they are refused."
    return super().get_help_record(ctx)


overwrite_option = click.option(
    "--overwrite/--no-overwrite", cls=_OverwriteOption, default=False, expose_value=False,
    callback=remember_overwrite, help="Replace existing output files; without it they are refused.")


def overwrite_requested() -> bool:
  """Whether this command was given --overwrite (see `overwrite_option`)."""
  ctx = click.get_current_context(silent=True)
  return bool(ctx is not None and ctx.meta.get("inspect_checkpoint.overwrite"))


def _given_paths(ctx: click.Context) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
  """(inputs, outputs) of the running command as (option, what it is, path): its `InputPath` and model files,
  its `OutputPath` and then `OutputDirectory` values (a file in the output directory is the one named)."""
  inputs, outputs, directories = [], [], []
  for param in ctx.command.params:
    value = ctx.params.get(param.name)
    if value is None:
      continue
    option = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
    if isinstance(param.type, InputPath):
      inputs.append((option, param.type.role, value))
      if value.endswith(".safetensors.index.json"):  # an index is read with the shards beside it
        inputs.append((option, "the directory of the index", os.path.dirname(value) or "."))
    elif isinstance(param.type, OutputDirectory):
      directories.append((option, "the output directory", value))
    elif isinstance(param.type, OutputPath):
      outputs.append((option, "the output file", value))
  if ctx.params.get("overrides"):
    from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
    inputs += [("key=value", "the model file", path) for path in config.model_files(ctx.params["overrides"])]
  return inputs, outputs + directories


def check_apart_from_inputs() -> None:
  """Refuses an output of the running command that is, contains or lies inside one of its inputs or another of its
  outputs (`destination.check_apart`), with or without --overwrite."""
  from inspect_tool.output import destination  # pylint: disable=import-outside-toplevel

  ctx = click.get_current_context(silent=True)
  if ctx is None:
    return
  inputs, outputs = _given_paths(ctx)
  for i, (option, kind, path) in enumerate(outputs):
    others = [(f"{what} {given!r} ({name})", given) for name, what, given in inputs + outputs[:i] + outputs[i + 1:]]
    destination.check_apart(path, others, "output" if kind == "the output directory" else option)


def check_output_files(*paths: str | None) -> None:
  """Refuses, before any work, an output on or inside an input or another output (`check_apart_from_inputs`), and
  output files that exist (without --overwrite) or are directories or ''."""
  from inspect_tool.output import destination  # pylint: disable=import-outside-toplevel

  check_apart_from_inputs()
  for path in paths:
    if path is not None:
      destination.check_output_file(path, overwrite_requested())


def command_line() -> str:
  return "inspect_checkpoint " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def emit_report(report, *, fmt: str, check_dtype: bool, output_file: str | None, summary: bool) -> None:
  """Prints the report in `fmt`; writes MaxText's listing to `output_file` when asked."""
  from inspect_tool.report import listing  # pylint: disable=import-outside-toplevel

  if output_file:
    write_file(output_file, listing.format_output_file(report, command_line(), check_dtype=check_dtype))
  if fmt == "text":
    text = listing.format_text(report, check_dtype=check_dtype, with_summary=summary)
  elif fmt == "json":
    text = listing.format_json(report)
  else:
    text = listing.format_markdown(report, check_dtype=True)
  echo(text)


def echo(text: str) -> None:
  """Prints `text` (no newline added) to stdout; a failed write (a full disk, a closed pipe) is one line."""
  from inspect_tool.output import stdout  # pylint: disable=import-outside-toplevel

  stdout.echo(text)


def write_file(path: str, data: str | bytes) -> None:
  """Writes one output file by the single-file rule (`destination.check_output_file`), atomically, apart from the
  command's inputs (checked again: a directory may have been replaced by a link meanwhile)."""
  from inspect_tool.output import atomic  # pylint: disable=import-outside-toplevel

  check_apart_from_inputs()
  atomic.atomic_write_bytes(path, data.encode("utf-8") if isinstance(data, str) else data,
                            overwrite=overwrite_requested())


def emit_text(text: str, output_file: str | None) -> None:
  """Prints a report; with `output_file`, also writes it there, atomically (refused if it exists, see --overwrite)."""
  if output_file:
    write_file(output_file, text)
  echo(text)


def write_html(path: str, html: str) -> None:
  write_file(path, html)
  click.echo(f"wrote {path}", err=True)


def distributed_options(func):
  """--coordinator/--num-processes/--process-id/--timeout (see inspect_tool.distributed.runtime) and --quiet."""
  options = [
      click.option("--coordinator", type=str, help="HOST:PORT of process 0 for a multi-process (multi-host) job; "
                   "default: JAX's cluster detection, else one process."),
      click.option("--num-processes", "--num_processes", "num_processes", type=click.IntRange(min=1),
                   help="Processes in the job."),
      click.option("--process-id", "--process_id", "process_id", type=click.IntRange(min=0),
                   help="This process's index (0 first)."),
      click.option("--timeout", type=float, default=None,
                   help="Seconds a process waits for the others (joining, each step) before the job is abandoned "
                   "with one line on every process (default 300)."),
      click.option("--quiet", is_flag=True, help="No progress output on stderr."),
  ]
  for option in reversed(options):
    func = option(func)
  return func


def start_processes(coordinator, num_processes, process_id, quiet, timeout=None, *, jax_runtime: bool = True) -> None:
  """Applies `distributed_options`: --quiet, then joins the job (if any): JAX's distributed runtime, or with
  `jax_runtime=False` (export, import) a `distributed.job.Job`. Run it once every input is checked."""
  from inspect_tool import progress  # pylint: disable=import-outside-toplevel
  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel

  distributed.initialize(coordinator, num_processes, process_id, timeout=timeout, jax_runtime=jax_runtime)
  progress.set_quiet(quiet or distributed.process_index() != 0)  # process 0 speaks for the job


def _configure_compile_cache(ctx, param, value):  # pylint: disable=unused-argument
  ctx.meta["inspect_checkpoint.compile_cache"] = value
  if not ctx.resilient_parsing:
    if ctx.params.get("dst") is not None:  # export / import: a umask that forbids the output speaks first
      from inspect_tool.output import atomic  # pylint: disable=import-outside-toplevel
      atomic.check_umask(ctx.params["dst"])
    from inspect_tool.run import compile_cache  # pylint: disable=import-outside-toplevel
    compile_cache.configure(value)
  return value


compile_cache_option = click.option(
    "--compile-cache/--no-compile-cache", default=True, expose_value=False, callback=_configure_compile_cache,
    help="Keep compiled programs in JAX's persistent cache ($JAX_COMPILATION_CACHE_DIR, else "
         "~/.cache/inspect_checkpoint/jax) so a second run skips compiling; INSPECT_CHECKPOINT_COMPILE_CACHE=0 "
         "turns it off too.")
