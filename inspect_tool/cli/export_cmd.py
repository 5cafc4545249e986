"""`export`: write the quantization-applied model as an FP8 checkpoint, then validate it against its source."""

from __future__ import annotations

import json

import click

from inspect_tool.cli import options as cli_options

LAYOUTS = ("orbax", "deepseek-fp8")


@click.command()
@click.argument("overrides", nargs=-1)
@click.option("--checkpoint", "source", type=str,
              help="Float MaxText-layout Orbax checkpoint to export (default: the seeded random init).")
@click.option("--output", "dst", required=True, type=str,
              help="Output directory; it appears only when complete (with quantization_report.json).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output (kept intact if the export fails).")
@click.option("--tokens", "tokens_file", type=str,
              help="Validation tokens (batch, seq) .npy (default: a fixed 2x16 batch).")
@click.option("--targets", "targets_file", type=str, help="Validation targets .npy (default: tokens shifted left).")
@click.option("--min-top1", "--min_top1", "min_top1", type=click.FloatRange(0.0, 1.0), default=0.9,
              show_default=True, help="Exit 1 when any head's top-1 agreement with the source (same rules) is lower.")
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Run source and export on the batch and compare them (recorded in the report).")
@click.option("--layout", type=click.Choice(LAYOUTS), default="orbax", show_default=True,
              help="orbax: Qwix PTQ layout loadable by `forward`; deepseek-fp8: HF safetensors, 128x128 block scales.")
@click.option("--max-memory", "--max_memory", "max_memory", type=str,
              help="Peak memory to stay under, e.g. 600MB, 2GiB (default: half of the available memory); arrays "
                   "are read, quantized and written by slices that fit.")
@click.option("--format", "fmt", type=click.Choice(("text", "json")), default="text", show_default=True)
@cli_options.distributed_options
@cli_options.compile_cache_option
def export(overrides, source, dst, overwrite, tokens_file, targets_file, min_top1, validate, layout, max_memory, fmt,
           coordinator, num_processes, process_id, quiet):
  """Export the model of key=value overrides with its quantization applied (e.g. quantization=fp8_full).

  Every weight that a quantizing op consumes (dense kernels, router, logits head, routed experts via gmm, the MTP
  block with quantize_mtp=true) is written as float8_e4m3fn values plus scales at the forward pass's granularity;
  everything else is copied. Exit 0 when validation passes, 1 when a head's top-1 agreement is below --min-top1.

  Example: inspect_checkpoint export model_name=deepseek3-tiny mtp_num_layers=1 quantization=fp8_full
  --checkpoint CKPT --output OUT
  """
  from inspect_tool.fp8_export import pipeline  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import report  # pylint: disable=import-outside-toplevel
  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import budget  # pylint: disable=import-outside-toplevel

  max_bytes = budget.parse_size(max_memory) if max_memory is not None else None
  cli_options.start_processes(coordinator, num_processes, process_id, quiet)
  if layout == "deepseek-fp8":
    summary = pipeline.export_deepseek_fp8(overrides, dst, source=source, overwrite=overwrite,
                                           max_memory=max_bytes)
    if fmt == "json":
      click.echo(json.dumps(summary, indent=1))
    else:
      click.echo(f"wrote {summary['dst']}: {summary['num_tensors']} tensors ({summary['num_fp8']} fp8 with "
                 f"128x128 block scales) in {len(summary['files'])} file(s), {summary['total_size']:,} bytes")
    return 0
  data = None
  if validate and distributed.process_count() == 1:
    from inspect_tool.run import batch  # pylint: disable=import-outside-toplevel
    from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
    cfg = config.resolve_config(overrides)
    data = batch.load_batch(tokens_file, targets_file, vocab_size=cfg.vocab_size,
                            max_target_length=cfg.max_target_length)
  result = pipeline.export(overrides, dst, source=source, overwrite=overwrite, data=data, tokens_file=tokens_file,
                           min_top1=min_top1, run_validation=validate, command=cli_options.command_line(),
                           max_memory=max_bytes)
  if distributed.process_index() != 0:
    return 0  # process 0 reports
  if fmt == "json":
    click.echo(json.dumps(result.report, indent=1))
  else:
    click.echo(report.format_text(result), nl=False)
  return 0 if result.passed else 1
