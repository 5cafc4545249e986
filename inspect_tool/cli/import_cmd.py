"""`import`: a Hugging Face DeepSeek directory (the FP8 release or a float one) as a MaxText Orbax checkpoint."""

from __future__ import annotations

import json

import click

from inspect_tool.cli import options as cli_options


@click.command("import", epilog=cli_options.example("import --path tests/data/import/hf_small "
                                                     "--output hf_small_maxtext scan_layers=true"))
@cli_options.overrides_argument
@click.option("--path", "path", required=True, type=cli_options.InputPath("the source", file_okay=False),
              help="Hugging Face DeepSeek directory: config.json and safetensors (FP8 release layout or float).")
@click.option("--output", "dst", required=True, type=cli_options.OutputDirectory(),
              help="Output directory, or gs://BUCKET/PREFIX; it appears only when complete (DST/0/items, with "
                   "import_report.json; on gs://, commit_success.txt is written last).")
@click.option("--overwrite", is_flag=True, callback=cli_options.remember_overwrite,
              help="Replace an earlier import or export at --output (kept intact if this one fails), and "
              "--output_file.")
@click.option("--max-memory", "--max_memory", "max_memory", type=str,
              help="Peak memory to stay under, e.g. 600MB, 2GiB (default: half of the available memory); tensors "
                   "are read one layer and expert at a time and written into slices of MaxText's arrays.")
@cli_options.report_options(overwrite=False)
@cli_options.distributed_options
def import_(overrides, path, dst, overwrite, max_memory, fmt, output_file, coordinator, num_processes, process_id,
            timeout, quiet):
  """Import a Hugging Face DeepSeek directory into a MaxText Orbax checkpoint (MaxText's converter layout).

  The MaxText keys come from config.json and the stored tensors; key=value overrides may set scan_layers,
  weight_dtype (default float32) and param_scan_axis. FP8 weights are dequantized exactly (value x the
  weight_scale_inv of its 128x128 block); the MTP block comes from the release's nextn layer.
  """
  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import budget  # pylint: disable=import-outside-toplevel
  from inspect_tool.hf_import import inputs  # pylint: disable=import-outside-toplevel

  max_bytes = budget.parse_size(max_memory) if max_memory is not None else None
  cli_options.check_output_files(output_file)
  resolved = inputs.check_inputs(path, overrides, max_bytes)  # before joining (a bad input ends none), still light
  from inspect_tool.hf_import import pipeline  # pylint: disable=import-outside-toplevel
  cli_options.start_processes(coordinator, num_processes, process_id, quiet, timeout, jax_runtime=False)
  result = pipeline.import_checkpoint(path, dst, overrides, overwrite=overwrite, max_memory=max_bytes,
                                      command=cli_options.command_line(), resolved=resolved)
  if distributed.process_index() != 0:
    return 0
  text = json.dumps(result.report.to_dict(), indent=1) + "\n" if fmt == "json" else pipeline.format_text(result)
  cli_options.emit_text(text, output_file)
  return 0
