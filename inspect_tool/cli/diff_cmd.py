"""`diff`: the abstract model against an Orbax checkpoint's metadata; exit 1 when they disagree."""

from __future__ import annotations

import click

from inspect_tool.cli import options


@click.command(epilog=options.example("diff model_name=deepseek3-tiny mtp_num_layers=1 "
                                      "override_model_config=true base_num_decoder_layers=4 "
                                      "first_num_dense_layers=1 vocab_size=1024 --path "
                                      "tests/data/ckpt_deepseek3-tiny-L4-V1024"))
@options.overrides_argument
@click.option("--path", required=True, type=options.InputPath("the source"),
              help="Orbax checkpoint (step directory, its items directory, or steps "
              "directory) or Hugging Face DeepSeek directory (config.json + safetensors).")
@click.option("--filter", "key_filter", metavar="REGEX", help="List only the differences whose key contains a match "
              "of REGEX (the verdict and exit code stay the whole model's).")
@options.report_options(formats=options.FORMATS)
@options.distributed_options
def diff(overrides, path, key_filter, fmt, output_file, coordinator, num_processes, process_id, timeout, quiet):
  """Compare the model of key=value overrides with a checkpoint: missing, unexpected, shape and dtype mismatches.

  Exit code 0 when they agree, 1 when they do not.
  """
  from inspect_tool.fitting import check as checking  # pylint: disable=import-outside-toplevel
  from inspect_tool.hf import diff as hf_diff  # pylint: disable=import-outside-toplevel
  from inspect_tool.hf import restore as hf_restore  # pylint: disable=import-outside-toplevel
  from inspect_tool.report import diff_format  # pylint: disable=import-outside-toplevel

  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file)
  from inspect_tool.paramtree import select  # pylint: disable=import-outside-toplevel

  key_filter = select.compile_filter(key_filter)
  # metadata only: no computation across processes, so the job of `export` (bounded waits), not JAX's runtime
  options.start_processes(coordinator, num_processes, process_id, quiet, timeout, jax_runtime=False)
  compare = hf_diff.diff_config_hf if hf_restore.is_hf_checkpoint(path) else checking.diff_config_checkpoint
  source, result = compare(overrides, path)  # metadata only: every process reads it, process 0 reports
  if distributed.process_index() == 0:
    from inspect_tool.fitting import keys as fix  # pylint: disable=import-outside-toplevel
    result.fix = fix.suggest(list(overrides), path, result, compare, compare is hf_diff.diff_config_hf)
    options.emit_text(diff_format.FORMATTERS[fmt](result, source=source, path=path, key_filter=key_filter),
                      output_file)
  return 0 if result.agree else 1
