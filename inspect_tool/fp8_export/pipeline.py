"""The export flow: plan, read, quantize and write, validate, report, inside a claimed destination.

`destination.claim` checks DST against the inputs and locks it for the run; everything is written to a temporary
directory beside DST (`atomic.atomic_directory`) that replaces DST in one rename only when complete, report
included (see `inspect_tool.atomic` and `inspect_tool.destination`: what DST may be, the lock, stale
temporaries). `INSPECT_EXPORT_KILL_AT=<point>` makes the process SIGKILL itself at a named point (`KILL_POINTS`),
for tests.

Streaming: source arrays are restored a small group at a time (each onto the mesh), quantized and handed to
`quant.ptq_weights.OrbaxStreamWriter`, then dropped. Validation runs after writing, before DST appears.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from inspect_tool import atomic
from inspect_tool import config as config_lib
from inspect_tool import destination
from inspect_tool import errors
from inspect_tool import progress
from inspect_tool.fp8_export import load
from inspect_tool.fp8_export import plan as plan_lib
from inspect_tool.fp8_export import read
from inspect_tool.fp8_export import report as report_lib
from inspect_tool.fp8_export import validate as validate_lib
from inspect_tool.fp8_export import write_orbax

KILL_POINTS = ("start", "arrays", "written", "validated", "report", "swap", "swapped", "swap-aside")


@dataclasses.dataclass(frozen=True)
class ExportResult:
  dst: str
  report: dict
  validation: Any  # validate.Validation or None (skipped)

  @property
  def passed(self) -> bool:
    return self.validation is None or self.validation.passed


def export(tokens: Sequence[str], dst: str, *, source: str | None = None, overwrite: bool = False, data=None,
           tokens_file: str | None = None, min_top1: float = validate_lib.DEFAULT_MIN_TOP1,
           run_validation: bool = True, mesh=None, command: str | None = None,
           read_group_bytes: int = read.READ_GROUP_BYTES, flush_bytes: int | None = None) -> ExportResult:
  """Exports the quantization-applied model of `tokens` (key=value) from `source` (None: seeded init) to `dst`.

  Args:
    tokens: MaxText key=value overrides (with a quantization, e.g. quantization=fp8_full).
    dst: output directory; appears only when complete.
    source: Orbax checkpoint of the float model (step dir, items dir or steps dir); None: random init.
    overwrite: replace an existing `dst` (which survives any failure).
    data: `batch.Batch` for validation (default: the fixed 2x16 batch).
    tokens_file: where `data` came from (recorded in the report).
    min_top1: the validation gate (top-1 agreement of every head with the source under the same rules).
    run_validation: False skips validation (recorded as skipped).
    mesh: `jax.sharding.Mesh` to restore, quantize and write on (default: all devices on one axis).
    command: the command line (recorded in the report).
    read_group_bytes: source bytes restored per group.
    flush_bytes: output bytes buffered per Orbax write (default `quant.ptq_weights.DEFAULT_FLUSH_BYTES`).
  """
  tokens = list(tokens)
  cfg = config_lib.resolve_config(tokens)
  with destination.claim(dst, sources=[source], overwrite=overwrite) as claimed:
    return _export(cfg, tokens, claimed.path, source=source, overwrite=overwrite, data=data,
                   tokens_file=tokens_file, min_top1=min_top1, run_validation=run_validation, mesh=mesh,
                   command=command, read_group_bytes=read_group_bytes, flush_bytes=flush_bytes)


def _export(cfg, tokens, dst, *, source, overwrite, data, tokens_file, min_top1, run_validation, mesh, command,
            read_group_bytes, flush_bytes) -> ExportResult:
  """`export` once DST is claimed (checked against the inputs and locked)."""
  from inspect_tool import batch as batch_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel
  from quant import errors as quant_errors  # pylint: disable=import-outside-toplevel

  if source is not None:
    read.check_source(source)
  plan = plan_lib.plan_export(cfg)
  leaves = plan_lib.model_leaves(cfg)
  mesh = mesh if mesh is not None else restore.default_mesh()
  if run_validation and data is None:
    data = batch_lib.load_batch(None, None, vocab_size=cfg.vocab_size, max_target_length=cfg.max_target_length)
  with atomic.atomic_directory(dst, overwrite=overwrite) as tmp:
    atomic.test_point("start")
    step_dir = os.path.join(tmp, str(report_lib.STEP))
    arrays = (read.checkpoint_arrays(source, leaves, mesh, read_group_bytes) if source is not None
              else read.init_arrays(cfg, leaves, mesh))
    try:
      with progress.step(f"exporting {len(leaves)} arrays ({len(plan.weights)} quantized)"):
        written = write_orbax.write_arrays(plan, arrays, len(leaves), step_dir, item=report_lib.ITEM,
                                           flush_bytes=flush_bytes)
    except quant_errors.QuantError as e:  # name the destination, not its temporary directory
      raise errors.InputError(str(e).replace(tmp, dst)) from None
    atomic.test_point("written")
    validation = None
    if run_validation:
      validation = validate_lib.validate(cfg, source, step_dir, data, min_top1=min_top1, mesh=mesh,
                                         tokens=tokens_file or "fixed")
    atomic.test_point("validated")
    report = report_lib.build_report(plan, tokens=tokens, source=source, command=command, copied=written.copied,
                                     source_bytes=written.source_bytes, written_bytes=written.written_bytes,
                                     mesh_devices=int(mesh.size), validation=validation)
    atomic.atomic_write_text(os.path.join(tmp, load.REPORT_NAME), json.dumps(report, indent=1) + "\n")
    atomic.test_point("report")
  return ExportResult(os.path.abspath(dst), report, validation)


def export_deepseek_fp8(tokens: Sequence[str], dst: str, *, source: str | None = None, overwrite: bool = False,
                        mesh=None) -> dict:
  """`--layout deepseek-fp8`: DeepSeek-V3's FP8 release layout (HF safetensors, 128x128 block scales).

  The conversion is `write_hf.write_deepseek_fp8`; here the source arrays are read one at a time and the
  output directory appears only when complete. Its quantization is the release's, not the config's rules,
  and our model cannot load that layout, so there is no validation run.
  """
  from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  cfg = config_lib.resolve_config(list(tokens))
  with destination.claim(dst, sources=[source], overwrite=overwrite) as claimed:
    if source is not None:
      read.check_source(source)
    leaves = plan_lib.model_leaves(cfg)
    mesh = mesh if mesh is not None else restore.default_mesh()
    arrays = (read.LazyArrays(source, leaves, mesh) if source is not None
              else {leaf.key: array for leaf, array in read.init_arrays(cfg, leaves, mesh)})
    with atomic.atomic_directory(claimed.path, overwrite=overwrite) as tmp:
      with progress.step(f"writing DeepSeek FP8 safetensors ({len(leaves)} arrays)"):
        summary = write_hf.write_deepseek_fp8(arrays, cfg, tmp)
  summary = dict(summary, dst=claimed.path)
  summary.pop("config", None)
  return summary
