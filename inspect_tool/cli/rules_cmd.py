"""`rules`: which Qwix rule quantizes which op and weight (GMM experts and the MTP block included)."""

from __future__ import annotations

import click


@click.command()
@click.argument("overrides", nargs=-1)
@click.option("--rules", "rules_file", type=click.Path(dir_okay=False),
              help="YAML list of QtRule fields to use instead of MaxText's rules for the config.")
@click.option("--format", "fmt", type=click.Choice(("text", "json", "markdown", "html")), default="text",
              show_default=True, help="html: the treescope module tree marked by rule.")
@click.option("--strict", is_flag=True, help="Exit 1 on unused rules or an unquantized decoder matmul weight.")
@click.option("--explain", "explain_path", metavar="MODULE_PATH",
              help="Show each rule tried for one module path (e.g. decoder/moe_layers/self_attention/out).")
@click.option("--verbose", is_flag=True, help="Say on stderr which given keys the trace uses and which it ignores.")
def rules(overrides, rules_file, fmt, strict, explain_path, verbose):
  """Report Qwix rule coverage of the model given as key=value overrides (abstract trace, no memory).

  Example: inspect_checkpoint rules model_name=deepseek3-tiny mtp_num_layers=1 quantization=fp8_full quantize_mtp=true
  """
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.coverage import trace as model_coverage  # pylint: disable=import-outside-toplevel
  from quant import coverage_format, coverage_report  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(overrides)
  if verbose:
    click.echo("\n".join(config.describe_keys(overrides)), err=True)
  report = model_coverage.trace_coverage(cfg, rules_file)
  note = model_coverage.untraced_mtp(cfg)
  if note:
    click.echo(f"note: {note}", err=True)
  if explain_path:
    _check_traced(report, explain_path)
    click.echo(coverage_format.explain_text(coverage_report.explain(report, explain_path)), nl=False)
  elif fmt == "html":
    click.echo(model_coverage.coverage_html(cfg, report), nl=False)
  else:
    formatter = {"text": coverage_format.to_text, "json": coverage_format.to_json,
                 "markdown": coverage_format.to_markdown}[fmt]
    click.echo(formatter(report), nl=False)
  findings = report.strict_findings()
  if strict and findings:
    for finding in findings:
      click.echo(f"strict: {finding}", err=True)
    return 1
  return 0


def _check_traced(report, module_path: str) -> None:
  """Refuses (exit 2, closest traced module paths named) a path at which the trace recorded no op."""
  import difflib  # pylint: disable=import-outside-toplevel

  from inspect_tool import errors  # pylint: disable=import-outside-toplevel

  modules = list(dict.fromkeys(op.module for op in report.ops))
  if module_path in modules:
    return
  close = (difflib.get_close_matches(module_path, modules, n=3, cutoff=0.6)
           or difflib.get_close_matches(module_path, modules, n=1, cutoff=0.0))
  hint = f"; closest: {' or '.join(repr(c) for c in close)}" if close else "; the trace recorded no op at all"
  raise errors.InputError(f"--explain {module_path!r}: no traced op has this module path{hint} "
                          "(all of them: rules ... --format json)")
