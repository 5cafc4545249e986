"""`verify DST`: an export checked against its manifest; exit 1 naming the first tensor that differs."""

from __future__ import annotations

import click

from inspect_tool.cli import options


@click.command(epilog=options.example("verify /tmp/export"))
@click.argument("dst", type=options.InputPath("the export"))
@click.option("--max-memory", "--max_memory", "max_memory", type=str,
              help="Peak memory to stay under, e.g. 600MB, 2GiB (default: half of the available memory); tensors "
                   "are read and hashed in pieces that fit.")
@options.report_options()
def verify(dst, max_memory, fmt, output_file):
  """Re-read the export DST (local or gs://) and check every tensor against DST/export_manifest.json: each listed
  tensor stored with its shape, dtype and sha256, none other.

  Exit 0 with a one-line summary, 1 naming the first tensor that differs, 2 when the export or its manifest cannot
  be read (missing, malformed, a shard missing: one line on stderr).
  """
  import json  # pylint: disable=import-outside-toplevel

  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  from inspect_tool import progress  # pylint: disable=import-outside-toplevel
  from inspect_tool.manifest import build  # pylint: disable=import-outside-toplevel
  from inspect_tool.manifest import verify as verify_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import budget  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file)
  max_bytes = budget.resolve_max_memory(budget.parse_size(max_memory) if max_memory is not None else None)
  held = budget.current_rss()
  if max_bytes - held < 4 * (64 << 10):
    raise errors.InputError(f"--max-memory {budget.format_size(max_bytes)} is below what the process holds "
                            f"({budget.format_size(held)}); accepted: at least {budget.format_size(held + (1 << 20))}")
  with progress.step(f"verifying {dst}"):
    result = verify_lib.verify(dst, build.piece_bytes_for(max_bytes, held))
  if fmt == "json":
    text = json.dumps({"path": dst, "tensors": result.tensors, "bytes": result.nbytes, "passed": result.passed,
                       "finding": result.finding}, indent=1)
  elif result.passed:
    text = (f"verified {dst}: {result.tensors} tensors, {budget.format_size(result.nbytes)}, every sha256 as "
            f"{build.NAME} lists it")
  else:
    text = f"FAILED: {dst}: {result.finding}"
  options.emit_text(text + "\n", output_file)
  return 0 if result.passed else 1
