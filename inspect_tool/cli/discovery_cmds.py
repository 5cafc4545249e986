"""`presets`, `keys` and `topologies`: what `model_name=`, `key=value` and `--topology` accept."""

from __future__ import annotations

import click

from inspect_tool.cli import options


@click.command(epilog=options.example("presets --format json"))
@options.report_options()
def presets(fmt, output_file):
  """List every model preset (model_name=NAME): decoder and attention, parameters, MTP support, architecture.

  Parameters are counted on the abstract model as the preset sets it (mtp_num_layers=0), MaxText's Params only.
  """
  from inspect_tool.configuration import catalog  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import params  # pylint: disable=import-outside-toplevel
  from inspect_tool.report import catalog_format  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file)
  rows = catalog.preset_rows(params.parameter_count)
  formatter = catalog_format.presets_json if fmt == "json" else catalog_format.presets_text
  options.emit_text(formatter(rows), output_file)
  return 0


@click.command(epilog=options.example("keys 'mtp|quantiz'"))
@click.argument("pattern", required=False)
@options.report_options()
def keys(pattern, fmt, output_file):
  """List the keys key=value accepts: default, and what each changes here (tree, forward, rules, sharding, ...).

  PATTERN (a regular expression, or any part of a key's name) keeps the keys whose names it matches.
  """
  from inspect_tool.configuration import catalog, maxtext_keys  # pylint: disable=import-outside-toplevel
  from inspect_tool.report import catalog_format  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file)
  rows = catalog.key_rows(pattern)
  if not rows:
    from inspect_tool import errors  # pylint: disable=import-outside-toplevel
    raise errors.InputError(f"PATTERN {pattern!r} matches no key (all of them: inspect_checkpoint keys)")
  formatter = catalog_format.keys_json if fmt == "json" else catalog_format.keys_text
  options.emit_text(formatter(rows, maxtext_keys.AFFECTS), output_file)
  return 0


@click.command(epilog=options.example("topologies | grep v5p"))
@options.report_options()
def topologies(fmt, output_file):
  """List the slice names maxtext --topology takes (MaxText's compile_topology names) and their devices per slice."""
  from inspect_tool.report import catalog_format  # pylint: disable=import-outside-toplevel
  from inspect_tool.sharding import topology_table  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file)
  rows = topology_table.rows()
  formatter = catalog_format.topologies_json if fmt == "json" else catalog_format.topologies_text
  options.emit_text(formatter(rows), output_file)
  return 0
