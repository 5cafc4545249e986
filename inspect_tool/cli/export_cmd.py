"""`export`: write the quantization-applied model as an FP8 (or int8) checkpoint, then validate it against its
source."""

from __future__ import annotations

import json

import click

from inspect_tool.cli import options as cli_options
from inspect_tool.cli import param_types

LAYOUTS = ("orbax", "deepseek-fp8", "deepseek-bf16", "deepseek-v4")


@click.command(epilog=cli_options.example("export model_name=deepseek3-tiny mtp_num_layers=1 "
                                          "override_model_config=true base_num_decoder_layers=4 "
                                          "first_num_dense_layers=1 vocab_size=1024 quantization=fp8_full "
                                          "--checkpoint tests/data/ckpt_deepseek3-tiny-L4-V1024 --output "
                                          "/tmp/tiny-fp8"))
@cli_options.overrides_argument
@click.option("--checkpoint", "source", type=cli_options.InputPath("the source"),
              help="Float MaxText-layout Orbax checkpoint to export.")
@click.option("--random-init", "--random_init", "random_init", is_flag=True,
              help="Export the seeded random init (init_weights_seed) instead of a checkpoint: a test of the tool, "
                   "not of a model.")
@click.option("--output", "dst", type=cli_options.OutputDirectory(),
              help="Output directory, or gs://BUCKET/PREFIX; it appears only when complete (with "
                   "quantization_report.json; on gs://, commit_success.txt is written last).")
@click.option("--overwrite", is_flag=True, callback=cli_options.remember_overwrite,
              help="Replace an existing --output (kept intact if the export fails) and --output_file.")
@click.option("--tokens", "tokens_file", type=cli_options.InputPath("the tokens file"),
              help="Validation tokens (batch, seq) .npy (default: a fixed 2x16 batch).")
@click.option("--targets", "targets_file", type=cli_options.InputPath("the targets file"),
              help="Validation targets .npy (default: tokens shifted left).")
@click.option("--max-kl", "--max_kl", "max_kl", type=param_types.Bounded(float, 0.0, 100.0), default=0.015,
              show_default=True, help="Exit 1 when any head's KL divergence (nats) from the source run with the "
                                      "export's own numerics is higher (MaxText's max_kl_div).")
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Run source and export on the batch and compare them (recorded in the report).")
@click.option("--layout", type=click.Choice(LAYOUTS), default="orbax", show_default=True,
              help="orbax: Qwix PTQ layout loadable by `forward`; deepseek-fp8: HF safetensors, 128x128 block scales; "
                   "deepseek-bf16: HF safetensors in the release's names, bf16, unquantized (back from `import`); "
                   "deepseek-v4: DeepSeek-V4's release (FP4 experts, FP8 rest, ue8m0 scales).")
@click.option("--scale-fmt", "--scale_fmt", "scale_fmt", type=click.Choice(("float", "ue8m0")),
              help="With --layout deepseek-fp8: ue8m0 writes power-of-two scales and scale_fmt ue8m0 (DeepSeek-V3.1's "
                   "layout); float (default): absmax / 448. deepseek-v4 is always ue8m0.")
@click.option("--max-memory", "--max_memory", "max_memory", type=str,
              help="Peak memory to stay under, e.g. 600MB, 2GiB (default: half of the available memory); arrays "
                   "are read, quantized and written by slices that fit.")
@click.option("--topology", help="With --compile: the TPU slice (v5p-8, v5e-256, ...; `inspect_checkpoint topologies`).")
@click.option("--compile", "compile_", is_flag=True,
              help="Export nothing: compile the export's validation forward pass (the model under the config's "
                   "quantization, at per_device_batch_size x devices x max_target_length) for the --topology TPU "
                   "slice with libtpu, and print XLA's per-device memory and verdict (exit 1 when it does not fit).")
@cli_options.report_options(overwrite=False)
@cli_options.distributed_options
@cli_options.compile_cache_option
def export(overrides, source, random_init, dst, overwrite, tokens_file, targets_file, max_kl, validate, layout,
           scale_fmt, max_memory, topology, compile_, fmt, output_file, coordinator, num_processes, process_id, timeout,
           quiet):
  """Export the model of key=value overrides with its quantization applied (e.g. quantization=fp8_full).

  Every weight that a quantizing op consumes (dense kernels, router, logits head, routed experts via gmm, the MTP
  block with quantize_mtp=true) is written as the rule's weight type (float8_e4m3fn; int8 with quantization=int8)
  plus scales at the forward pass's granularity; everything else is copied. Exit 0 when validation passes, 1 when
  a head's KL from the source is above --max-kl.

  The weights are a checkpoint (--checkpoint) or, only when asked (--random-init), the seeded random init; the
  first line printed says which.
  """
  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import pipeline  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import report  # pylint: disable=import-outside-toplevel
  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import budget  # pylint: disable=import-outside-toplevel

  if compile_:
    return _compile_only(overrides, topology, fmt, output_file)
  if dst is None:
    raise click.UsageError("Missing option '--output' (or give --compile --topology T to only check that the "
                           "export's forward pass fits a TPU slice)")
  if topology is not None:
    raise click.UsageError("--topology is for --compile (checking the export's forward pass on a TPU slice)")
  if source is None and not random_init:
    raise errors.InputError("export needs --checkpoint CKPT (the float MaxText Orbax checkpoint to export); "
                            "accepted without one: --random-init, to export the seeded random init")
  if source is not None and random_init:
    raise errors.InputError(f"--random-init and --checkpoint {source!r} exclude each other; accepted: one of them")
  max_bytes = budget.parse_size(max_memory) if max_memory is not None else None
  if scale_fmt is not None and layout == "orbax":
    raise errors.InputError(f"--scale-fmt {scale_fmt} applies to the Hugging Face layouts; accepted: --layout "
                            "deepseek-fp8 --scale-fmt ue8m0, or no --scale-fmt with --layout orbax")
  if layout != "orbax":
    from inspect_tool.hf import layouts as hf_layouts  # pylint: disable=import-outside-toplevel
    hf_layouts.resolve(layout, scale_fmt)
  cli_options.check_output_files(output_file)
  several = distributed.check_flags(coordinator, num_processes, process_id, timeout)
  if several and layout != "orbax":
    raise errors.InputError(f"--layout {layout} is written by one process; accepted: --layout orbax with "
                            f"--num-processes {num_processes}, or --layout {layout} without --coordinator, "
                            "--num-processes and --process-id")
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  cfg = config.resolve_config(overrides)  # every input checked before joining: a bad one ends no other process
  if layout != "orbax":
    hf_layouts.check_quantization(hf_layouts.resolve(layout, scale_fmt), cfg.quantization)
  budget.resolve_max_memory(max_bytes)
  data = None
  if validate:
    from inspect_tool.run import batch  # pylint: disable=import-outside-toplevel
    data = batch.load_batch(tokens_file, targets_file, vocab_size=cfg.vocab_size,
                            max_target_length=cfg.max_target_length)
  from inspect_tool.run import weights  # pylint: disable=import-outside-toplevel
  used = weights.resolve(cfg, source)  # the checkpoint found (or named in one line) before joining, once
  cli_options.start_processes(coordinator, num_processes, process_id, quiet, timeout, jax_runtime=False)
  batch_options = [*(["--tokens", tokens_file] if tokens_file else []),
                   *(["--targets", targets_file] if targets_file else [])]
  if layout != "orbax":
    if distributed.process_count() > 1:  # a job JAX's cluster detection found
      raise errors.InputError(f"--layout {layout} is written by one process; this job has "
                              f"{distributed.process_count()}; accepted: --layout orbax")
    result = pipeline.export_deepseek_fp8(overrides, dst, cfg=cfg, source=used, overwrite=overwrite, data=data,
                                          tokens_file=tokens_file, max_kl=max_kl, run_validation=validate,
                                          command=cli_options.command_line(), max_memory=max_bytes,
                                          batch_options=batch_options, layout=layout, scale_fmt=scale_fmt)
  else:
    result = pipeline.export(overrides, dst, cfg=cfg, source=used, overwrite=overwrite, data=data,
                             tokens_file=tokens_file, max_kl=max_kl, run_validation=validate,
                             command=cli_options.command_line(), max_memory=max_bytes, batch_options=batch_options)
  if distributed.process_index() != 0:
    return 0  # process 0 reports
  if fmt == "json":
    text = json.dumps(result.report.to_dict(), indent=1) + "\n"
  else:
    formatter = report.format_text if layout == "orbax" else report.format_hf_text
    text = f"weights: {used.label}\n" + formatter(result)
  cli_options.emit_text(text, output_file)
  return 0 if result.passed else 1


def _compile_only(overrides, topology, fmt, output_file) -> int:
  """`export --compile --topology T`: XLA's verdict on the export's validation forward pass, nothing exported."""
  if topology is None:
    raise click.UsageError("--compile needs --topology NAME (a TPU slice: v5p-8, v5e-256, ...)")
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.xla_compile import libtpu  # pylint: disable=import-outside-toplevel
  from inspect_tool.xla_compile import topology as topology_lib  # pylint: disable=import-outside-toplevel

  cli_options.check_output_files(output_file)
  topology_lib.slice_of(topology)
  libtpu.require()
  cfg = config.resolve_config(overrides)
  from inspect_tool import xla_compile  # pylint: disable=import-outside-toplevel
  from inspect_tool.xla_compile import cache  # pylint: disable=import-outside-toplevel
  cache.set_enabled(click.get_current_context().meta.get("inspect_checkpoint.compile_cache", True))
  verdict = xla_compile.judge(cfg, topology)
  if fmt == "json":
    text = json.dumps({"xla": verdict.to_dict()}, indent=1) + "\n"
  else:
    text = "\n".join(verdict.text_lines()[1:]) + "\n"
  cli_options.emit_text(text, output_file)
  return 0 if verdict.fits else 1

