"""`rules`: which Qwix rule quantizes which op and weight (GMM experts and the MTP block included)."""

from __future__ import annotations

import dataclasses

import click

from inspect_tool.cli import options


@click.command(epilog=options.example("rules model_name=deepseek3-tiny mtp_num_layers=1 quantization=fp8_full "
                                      "quantize_mtp=true --chip v5p --html coverage.html"))
@options.overrides_argument
@click.option("--rules", "rules_file", type=options.InputPath("the rules file", dir_okay=False),
              help="YAML list of QtRule fields to use instead of MaxText's rules for the config.")
@click.option("--strict", is_flag=True, help="Exit 1 on unused rules or an unquantized decoder matmul weight; "
              "the verdict (passed or FAILED) is the last line on stderr.")
@click.option("--explain", "explain_path", metavar="PATH",
              help="Show each rule tried for one module or weight, dotted as listings print it or as a module "
              "path: decoder/moe_layers/self_attention/out.")
@click.option("--verbose", is_flag=True, help="Say on stderr which given keys the trace uses and which it ignores.")
@options.chip_options
@options.report_options(formats=("text", "json", "markdown", "html"), html="the module tree marked by rule")
def rules(overrides, rules_file, strict, explain_path, verbose, topology, chip, fmt, output_file, html_file):
  """Report Qwix rule coverage of the model given as key=value overrides (abstract trace, no memory).

  --format html prints the treescope page on stdout; --html FILE writes it to FILE beside the report.
  """
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.coverage import trace as model_coverage  # pylint: disable=import-outside-toplevel
  from inspect_tool.report import coverage_format, coverage_report  # pylint: disable=import-outside-toplevel

  options.check_output_files(output_file, html_file)
  cfg = config.resolve_config(overrides)
  if verbose:
    click.echo("\n".join(config.describe_keys(overrides)), err=True)
  on = options.chip_of(topology, chip)
  report = model_coverage.trace_coverage(cfg, rules_file)
  if on is not None:
    from inspect_tool.report import chip_fit  # pylint: disable=import-outside-toplevel
    report = dataclasses.replace(report, chip=chip_fit.build(on, report.glance))
  note = model_coverage.untraced_mtp(cfg)
  if note:
    click.echo(f"note: {note}", err=True)
  page = model_coverage.coverage_html(cfg, report, overrides) if html_file or (fmt == "html" and not explain_path) else None
  if explain_path:
    module = _traced_module(report, explain_path)
    options.emit_text(coverage_format.explain_text(coverage_report.explain(report, module)), output_file)
  elif fmt == "html":
    options.emit_text(page, output_file)
  else:
    formatter = {"text": coverage_format.to_text, "json": coverage_format.to_json,
                 "markdown": coverage_format.to_markdown}[fmt]
    options.emit_text(formatter(report), output_file)
  if html_file:
    options.write_html(html_file, page)
  if not strict:
    return 0
  findings = report.strict_findings()
  for finding in findings:
    click.echo(f"strict: {finding}", err=True)
  click.echo(coverage_report.strict_verdict(report, findings), err=True)
  return 1 if findings else 0


def _traced_module(report, name: str) -> str:
  """The traced module `name` means (a module path, or a weight, either spelling), else refused (exit 2) with the
  closest traced module paths named."""
  import difflib  # pylint: disable=import-outside-toplevel

  from inspect_tool import errors  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import spelling  # pylint: disable=import-outside-toplevel

  module_path = spelling.to_slash(name)
  modules = list(dict.fromkeys(op.module for op in report.ops))
  if module_path in modules:
    return module_path
  owners = [op.module for op in report.ops if op.weight == module_path]
  if owners:
    return owners[0]
  close = (difflib.get_close_matches(module_path, modules, n=3, cutoff=0.6)
           or difflib.get_close_matches(module_path, modules, n=1, cutoff=0.0))
  hint = f"; closest: {' or '.join(repr(c) for c in close)}" if close else "; the trace recorded no op at all"
  raise errors.InputError(f"--explain {name!r}: no traced op has this module path{hint} "
                          "(all of them: rules ... --format json)")
