"""`maxtext`, `orbax` and `hf`: list a parameter tree from a config, a checkpoint or safetensors files."""

from __future__ import annotations

import dataclasses

import click

from inspect_tool.cli import options
from inspect_tool.cli import param_types

MAX_DEVICES = 1 << 20  # far above any slice or job MaxText runs on


@click.command(epilog=options.example("maxtext model_name=deepseek3-671b mtp_num_layers=1 --summary "
                                      "--topology v5p-256 --device-memory 95GiB"))
@options.overrides_argument
@click.option("--all", "include_all", is_flag=True, help="Also list non-Param state (the DeepSeek-V3 gate bias).")
@click.option("--verbose", is_flag=True, help="Say on stderr which given keys shape the tree and which are ignored.")
@click.option("--devices", type=param_types.Bounded(int, 1, MAX_DEVICES),
              help="Shard on an abstract mesh of N devices: spec and "
              "shard shape per parameter, as MaxText does from the ici_*/dcn_* keys and logical_axis_rules.")
@click.option("--topology", help="A MaxText slice name (v5p-512, v6e-64, a3, h100-8, ...; all of them: "
              "inspect_checkpoint topologies) giving the device count and the memory of one device (its chip's), "
              "or a chip's name (v5p, h100, b200) with --devices.")
@click.option("--train", type=click.Choice(["adamw", "adam_pax", "sgd"]),
              help="With --summary: add optimizer state and gradients per device (default: MaxText's opt_type "
              "when the config sets it).")
@click.option("--compile", "compile_", is_flag=True, help="Compile the step for the --topology TPU slice with libtpu "
              "(no TPU needed; the `tpu` extra installs it) and print XLA's per-device memory beside the plan: the "
              "training step with --train, else the forward pass. The verdict is XLA's: exit 1 when it does not fit.")
@click.option("--device-memory", "device_memory", help="Memory of one device (95GiB, 80GB; default: the --topology "
              "chip's): exit 1 when the largest device does not fit, naming the largest contributors and what fits.")
@options.chip_option
@options.output_options
@options.listing_options
def maxtext(overrides, include_all, verbose, devices, topology, train, compile_, device_memory, chip, fmt,
            check_dtype, output_file, html_file, summary, key_filter, collapse):
  """List the parameters of a MaxText model given as key=value overrides."""
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.listings import model_listing  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import select  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file, html_file)
  key_filter = select.compile_filter(key_filter)
  if compile_:
    _check_compile(topology, key_filter)
  cfg = config.resolve_config(overrides)
  if compile_:
    from inspect_tool.xla_compile import sizes  # pylint: disable=import-outside-toplevel
    sizes.check(cfg, topology)  # before the model is traced
  if verbose:
    click.echo("\n".join(config.describe_keys(overrides)), err=True)
  from inspect_tool import sharding  # pylint: disable=import-outside-toplevel

  devices = sharding.devices_for(cfg, devices, topology)
  if devices is None and (train or device_memory):
    raise click.UsageError("--train and --device-memory need --devices N or --topology NAME")
  if chip is not None and not summary and fmt == "text":
    raise click.UsageError("--chip reports with the summary: add --summary (or --format json / markdown)")
  if key_filter is not None and device_memory:
    raise click.UsageError("--device-memory judges the whole model; it cannot be given with --filter")
  report, model = model_listing.model_listing(cfg, include_all=include_all, source=config.model_source(overrides),
                                              key_filter=key_filter, fp8_column=summary or fmt != "text",
                                              chip=options.chip_of(topology, chip))
  if devices is not None:
    report = sharding.annotate(report, cfg, devices=devices, train=train, device_memory=device_memory,
                               topology=topology, overrides=overrides)
  if compile_:
    from inspect_tool import xla_compile  # pylint: disable=import-outside-toplevel
    verdict = xla_compile.judge(cfg, topology, train=train, device_memory=device_memory, leaves=report.leaves,
                                plan_memory=report.memory, overrides=overrides)
    plan = report.memory and dataclasses.replace(report.memory, limit=None, advice=None)  # the verdict is XLA's
    report = dataclasses.replace(report, xla=verdict, memory=plan)
  report = options.listing_view(report, collapse=collapse)
  options.emit_report(report, fmt=fmt, check_dtype=check_dtype, output_file=output_file, summary=summary)
  if html_file:
    from inspect_tool.report import html  # pylint: disable=import-outside-toplevel
    options.write_html(html_file, html.render_model_html(model, title=report.source, sharding=report.sharding))
  if report.xla is not None:
    if not report.xla.fits:
      click.echo(f"does not fit: {report.xla.verdict()}", err=True)
    return 0 if report.xla.fits else 1
  if report.memory is not None and report.memory.fits is False:
    from inspect_tool.sharding import memory  # pylint: disable=import-outside-toplevel
    click.echo(memory.overflow_message(report.memory), err=True)
    return 1
  return 0


def _check_compile(topology, key_filter) -> None:
  """`--compile` needs a TPU slice name and libtpu, checked before any work; it judges the whole model."""
  if topology is None:
    raise click.UsageError("--compile needs --topology NAME (a TPU slice: v5p-8, v5e-256, ...)")
  if key_filter is not None:
    raise click.UsageError("--compile compiles the whole model; it cannot be given with --filter")
  from inspect_tool.xla_compile import libtpu  # pylint: disable=import-outside-toplevel
  from inspect_tool.xla_compile import topology as topology_lib  # pylint: disable=import-outside-toplevel
  topology_lib.slice_of(topology)
  libtpu.require()


@click.command(epilog=options.example("orbax --path tests/data/ckpt_deepseek3-tiny-L4-V1024 --summary"))
@click.option("--path", required=True, type=options.InputPath("the source"),
              help="Step directory, its items directory, or a directory of steps.")
@click.option("--all", "include_all", is_flag=True, help="List every item (nnx_aux, opt_state, step), grouped.")
@options.output_options
@options.listing_options
def orbax(path, include_all, fmt, check_dtype, output_file, html_file, summary, key_filter, collapse):
  """List an Orbax checkpoint's arrays from its metadata; array data is never read."""
  from inspect_tool.listings import orbax_listing  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import select  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file, html_file)
  key_filter = select.compile_filter(key_filter)
  report = options.listing_view(orbax_listing.orbax_listing(path, include_all=include_all, key_filter=key_filter),
                                collapse=collapse)
  for note in report.notes:
    click.echo(note, err=True)
  _emit_leaves(report, path, fmt, check_dtype, output_file, html_file, summary)
  return 0


def _emit_leaves(report, title, fmt, check_dtype, output_file, html_file, summary):
  options.emit_report(report, fmt=fmt, check_dtype=check_dtype, output_file=output_file, summary=summary)
  if html_file:
    from inspect_tool.report import html  # pylint: disable=import-outside-toplevel
    options.write_html(html_file, html.render_leaves_html(list(report.leaves), title=title))


@click.command(epilog=options.example("hf --path tests/data/import/hf_small --summary"))
@click.option("--path", required=True, type=options.InputPath("the source"),
              help="A .safetensors file, a directory of them, or a sharded index.json set.")
@click.option("--keys", "keys", is_flag=True, help="Print the MaxText keys of the DeepSeek directory (config.json and "
              "the stored tensors) as one line of key=value, instead of the listing.")
@options.output_options
@options.listing_options
def hf(path, keys, fmt, check_dtype, output_file, html_file, summary, key_filter, collapse):
  """List HF safetensors tensors from their headers (no torch, no tensor data)."""
  from inspect_tool.listings import hf_listing  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import select  # pylint: disable=import-outside-toplevel

  if keys:
    from inspect_tool.hf import config as hf_config  # pylint: disable=import-outside-toplevel
    options.echo(" ".join(hf_config.tokens(hf_config.derive_keys(path))) + "\n")
    return 0
  options.check_output_files(output_file, html_file)
  key_filter = select.compile_filter(key_filter)
  report = options.listing_view(hf_listing.hf_listing(path, key_filter=key_filter), collapse=collapse)
  _emit_leaves(report, path, fmt, check_dtype, output_file, html_file, summary)
  return 0
