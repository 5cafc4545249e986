"""Options shared by the commands, and the one place that writes a report to stdout or files."""

from __future__ import annotations

import shlex
import sys

import click

FORMATS = ("text", "json", "markdown")


def output_options(func):
  """--format, --check_dtype, --output_file, --html, --summary for every listing command."""
  options = [
      click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
                   help="Output format on stdout."),
      click.option("--check-dtype/--no-check-dtype", "--check_dtype", "check_dtype", default=False,
                   help="Show dtypes (MaxText spelling --check_dtype=true works too)."),
      click.option("--output-file", "--output_file", "output_file", type=click.Path(dir_okay=False),
                   help="Also write MaxText's listing (with a '# <command>' header) to this file, atomically."),
      click.option("--html", "html_file", type=click.Path(dir_okay=False),
                   help="Write a self-contained treescope HTML page of the tree to this file."),
      click.option("--summary/--no-summary", default=False,
                   help="With text format, add the summary by group (always in json/markdown)."),
      overwrite_option,
  ]
  for option in reversed(options):
    func = option(func)
  return func


def _remember_overwrite(ctx, param, value):  # pylint: disable=unused-argument
  ctx.meta["inspect_checkpoint.overwrite"] = bool(value)
  return value


overwrite_option = click.option(
    "--overwrite/--no-overwrite", default=False, expose_value=False, callback=_remember_overwrite,
    help="Replace existing output files (--output_file, --html, --save-logits); without it they are refused.")


def overwrite_requested() -> bool:
  """Whether this command was given --overwrite (see `overwrite_option`)."""
  ctx = click.get_current_context(silent=True)
  return bool(ctx is not None and ctx.meta.get("inspect_checkpoint.overwrite"))


def check_output_files(*paths: str | None) -> None:
  """Refuses, before any work, output files that exist (without --overwrite) or are directories or ''."""
  from inspect_tool.output import destination  # pylint: disable=import-outside-toplevel

  for path in paths:
    if path is not None:
      destination.refuse_existing_file(path, overwrite_requested())


def command_line() -> str:
  return "inspect_checkpoint " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def emit_report(report, *, fmt: str, check_dtype: bool, output_file: str | None, summary: bool) -> None:
  """Prints the report in `fmt`; writes MaxText's listing to `output_file` when asked."""
  from inspect_tool.output import atomic  # pylint: disable=import-outside-toplevel
  from inspect_tool.report import listing  # pylint: disable=import-outside-toplevel

  if output_file:
    check_output_files(output_file)
    atomic.atomic_write_text(output_file, listing.format_output_file(report, command_line(), check_dtype=check_dtype))
  if fmt == "text":
    text = listing.format_text(report, check_dtype=check_dtype, with_summary=summary)
  elif fmt == "json":
    text = listing.format_json(report)
  else:
    text = listing.format_markdown(report, check_dtype=True)
  click.echo(text, nl=False)


def write_html(path: str, html: str) -> None:
  from inspect_tool.output import atomic  # pylint: disable=import-outside-toplevel

  check_output_files(path)
  atomic.atomic_write_text(path, html)
  click.echo(f"wrote {path}", err=True)


def distributed_options(func):
  """--coordinator/--num-processes/--process-id (jax.distributed; see inspect_tool.distributed.runtime) and --quiet."""
  options = [
      click.option("--coordinator", type=str, help="HOST:PORT of process 0 for a multi-process (multi-host) job; "
                   "default: JAX's cluster detection, else one process."),
      click.option("--num-processes", "--num_processes", "num_processes", type=int, help="Processes in the job."),
      click.option("--process-id", "--process_id", "process_id", type=int, help="This process's index (0 first)."),
      click.option("--quiet", is_flag=True, help="No progress output on stderr."),
  ]
  for option in reversed(options):
    func = option(func)
  return func


def start_processes(coordinator, num_processes, process_id, quiet) -> None:
  """Applies `distributed_options`: --quiet, then joins the jax.distributed job (if any)."""
  from inspect_tool import progress  # pylint: disable=import-outside-toplevel
  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel

  distributed.initialize(coordinator, num_processes, process_id)
  progress.set_quiet(quiet or distributed.process_index() != 0)  # process 0 speaks for the job


def _configure_compile_cache(ctx, param, value):  # pylint: disable=unused-argument
  if not ctx.resilient_parsing:
    from inspect_tool.run import compile_cache  # pylint: disable=import-outside-toplevel
    compile_cache.configure(value)
  return value


compile_cache_option = click.option(
    "--compile-cache/--no-compile-cache", default=True, expose_value=False, callback=_configure_compile_cache,
    help="Keep compiled programs in JAX's persistent cache ($JAX_COMPILATION_CACHE_DIR, else "
         "~/.cache/inspect_checkpoint/jax) so a second run skips compiling; INSPECT_CHECKPOINT_COMPILE_CACHE=0 "
         "turns it off too.")
