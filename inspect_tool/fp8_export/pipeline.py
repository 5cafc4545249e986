"""`inspect_checkpoint export`: the quantization-applied model of a config, written as an FP8 Orbax checkpoint.

Plan. The config's Qwix rules are traced over one abstract forward pass (`coverage.trace_coverage`); every op
a rule quantizes names the weight it consumes, the axes it contracts and the dtype it sees. Each such weight is
exported at the granularity that forward pass uses (`quant.export`): dense kernels, routers and heads (Qwix QT
`dot_general`) one scale per non-contracted axis; routed experts (our `gmm`, or Qwix's quantized `ragged_dot`
with megablox=false) one scale per output column shared by the experts; a scanned stack's layer axis always keeps
its own scales. Weights consumed by no quantizing op
(norms, embedding, the DeepSeek-V3 gate bias, unmatched kernels) are copied unchanged (same dtype).

Layout (Orbax, OCDBT + zarr3, the MaxText converter layout): `DST/0/items/params/params/<module path>/<name>`
for copied arrays, `.../<name>/array/qvalue` (float8_e4m3fn, the weight's shape) and `.../<name>/array/scale`
(the weight's rank, 1 on shared axes) for quantized ones — Qwix PTQ's layout, used for experts too. Scanned
stacks stay scanned (layer axis at `param_scan_axis`), so e.g. the experts `MoeBlock_0/wi_0` (X, L, E, F) get
a scale of shape (1, L, 1, F) and a dense `wq_b/kernel` (R, L, H, D) one of (1, L, H, D). Scales are stored in
the dtype the forward pass quantizes in (the compute dtype, bfloat16 by default): exactly Qwix PTQ's scales, and
exactly (in value) the float32 scales of the FP8 grouped matmul. Everything, the gate bias included, is written
under `params/params` (MaxText's params-only loaders find the bias there too). `DST/quantization_report.json`
holds the rules, coverage summary, each quantized weight (qtype, scale shape, granularity), the copied
leaves, the validation results, the producer, the source and the command.

Streaming. Source arrays are restored a small group at a time (each onto the mesh), quantized and handed to
`quant.export.OrbaxStreamWriter`, then dropped: memory holds about one group of source arrays, one flush of
output and the transients of the array at hand, so it follows the largest array, never the model
(bench/bench_export.py). Safe writes: everything goes to a temporary directory beside DST that replaces DST in
one rename only when complete (report included); see `inspect_tool.atomic` and `inspect_tool.destination`
(what DST may be, the lock, stale temporaries). `INSPECT_EXPORT_KILL_AT=<point>` makes the process SIGKILL
itself at a named point (`KILL_POINTS`), for tests.

Validation runs after writing, before DST appears (`export_report`): the exported checkpoint, loaded into the
quantized model, against the source under the same rules (gated by `min_top1`) and the unquantized source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Iterator, Sequence

from inspect_tool import atomic
from inspect_tool import config as config_lib
from inspect_tool import destination
from inspect_tool import errors
from inspect_tool import export_report
from inspect_tool import progress
from inspect_tool import tree

KILL_POINTS = ("start", "arrays", "written", "validated", "report", "swap", "swapped", "swap-aside")
READ_GROUP_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ExportPlan:
  """Which weights of the config's model are exported quantized, and how."""

  cfg: config_lib.ModelConfig
  rules: tuple
  coverage: Any  # quant.coverage_report.CoverageReport
  weights: dict  # model leaf key -> quant.export.WeightQuant

  def expected_leaves(self, model_leaves: Sequence[tree.Leaf]) -> list[tree.Leaf]:
    """The exported checkpoint's leaves: model leaves with quantized weights as qvalue + scale."""
    out = []
    for leaf in model_leaves:
      wq = self.weights.get(leaf.key)
      if wq is None:
        out.append(leaf)
        continue
      out.append(tree.Leaf(wq.qvalue_key, wq.shape, wq.qtype))
      out.append(tree.Leaf(wq.scale_key, wq.scale_shape, wq.compute_dtype))
    return tree.sort_leaves(out)


def _layer_axis(cfg, stored_ndim: int) -> int:
  from inspect_tool.model import initializers  # pylint: disable=import-outside-toplevel

  return initializers.layer_axis(stored_ndim - 1, cfg.param_scan_axis)


def plan_export(cfg: config_lib.ModelConfig, rules: Sequence | None = None) -> ExportPlan:
  """Traces the config's rules (or `rules`) and plans the export of every weight a quantizing op consumes.

  Raises:
    errors.ConfigError: the config quantizes nothing.
    quant.errors.QuantError: a weight cannot be exported (unsupported qtype or rule, or its ops disagree).
  """
  from inspect_tool import coverage  # pylint: disable=import-outside-toplevel
  from quant import errors as quant_errors  # pylint: disable=import-outside-toplevel
  from quant import export as qexport  # pylint: disable=import-outside-toplevel
  from quant import fp8  # pylint: disable=import-outside-toplevel

  rule_list = coverage.config_rules(cfg) if rules is None else list(rules)
  if not rule_list:
    raise errors.ConfigError("export needs a quantization; pass e.g. quantization=fp8_full "
                             "(accepted: any quantization mode with fp8 weights)")
  with progress.step("tracing quantization rules"):
    report = coverage.trace_coverage(cfg, rule_list)
  planned: dict = {}
  for op in report.ops:
    if not (op.matmul and op.weight and report.op_quantized(op)):
      continue
    rule = report.rules[op.rule].rule
    if op.operand_shape is None or op.contracting is None:
      raise quant_errors.QuantError(f"cannot tell how {op.module}:{op.op} consumes {op.weight}; export needs the "
                                    "weight operand of every quantized op")
    local = qexport.op_channel_axes(op.op_name, len(op.operand_shape), op.contracting, rule)
    stored_shape = tuple(op.weight_shape)
    extra = qexport.extra_axes(op.operand_shape, stored_shape, preferred=_layer_axis(cfg, len(stored_shape)))
    wq = qexport.WeightQuant(
        key=tree.param_key(tuple(op.weight.split("/"))), shape=stored_shape,
        channel_axes=qexport.stored_channel_axes(local, op.operand_shape, stored_shape, extra),
        qtype=fp8.resolve_qtype(rule.weight_qtype).name, calibration=rule.weight_calibration_method or "absmax",
        compute_dtype=op.operand_dtype, kind="grouped" if op.op_name in qexport.GROUPED_OPS else "dense",
        ops=(f"{op.module}:{op.op}",))
    previous = planned.get(wq.key)
    if previous is not None:
      if dataclasses.replace(previous, ops=()) != dataclasses.replace(wq, ops=()):
        raise quant_errors.QuantError(f"weight {op.weight} is quantized differently by {previous.ops[0]} and "
                                      f"{wq.ops[0]}; export needs one granularity per weight")
      wq = dataclasses.replace(previous, ops=previous.ops + wq.ops)
    planned[wq.key] = wq
  for row in report.weights:  # a weight stored quantized must be quantized by every op that reads it
    key = tree.param_key(tuple(row.weight.split("/")))
    if key in planned and len(planned[key].ops) != len(row.ops):
      plain = [o for o in row.ops if o not in planned[key].ops]
      raise quant_errors.QuantError(f"weight {row.weight} is quantized by {planned[key].ops[0]} but read "
                                    f"unquantized by {plain[0]}; export needs every op of a weight to quantize it")
  return ExportPlan(cfg=cfg, rules=tuple(rule_list), coverage=report, weights=planned)


def model_leaves(cfg: config_lib.ModelConfig) -> list[tree.Leaf]:
  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool import params  # pylint: disable=import-outside-toplevel

  return params.param_leaves(model_lib.build_model(cfg, abstract=True), include_non_params=True)


def expected_leaves(cfg: config_lib.ModelConfig) -> list[tree.Leaf]:
  """The leaves an export of this config holds (quantized weights as `array/qvalue` + `array/scale`)."""
  return plan_export(cfg).expected_leaves(model_leaves(cfg))


# ---------------------------------------------------------------------------------------------------------------
# Source arrays, one at a time.


def _nbytes(leaf: tree.Leaf) -> int:
  import numpy as np  # pylint: disable=import-outside-toplevel

  return leaf.size * np.dtype(leaf.dtype).itemsize


def _groups(pairs, budget: int):
  group, size = [], 0
  for pair in pairs:
    if group and size + _nbytes(pair.checkpoint) > budget:
      yield group
      group, size = [], 0
    group.append(pair)
    size += _nbytes(pair.checkpoint)
  if group:
    yield group


def _checkpoint_arrays(source: str, leaves, mesh, budget: int) -> Iterator[tuple[tree.Leaf, Any]]:
  """(model leaf, jax.Array) for every model leaf, restored a group at a time onto `mesh`."""
  from inspect_tool.checkpoint import orbax_metadata, restore  # pylint: disable=import-outside-toplevel

  listing = orbax_metadata.read_listing(source)
  for group in _groups(restore.plan(listing, leaves), budget):
    arrays = restore.restore_pairs(listing, group, mesh=mesh)
    for pair in group:
      yield pair.model, arrays.pop(pair.model.key)


def _init_arrays(cfg, leaves, mesh) -> Iterator[tuple[tree.Leaf, Any]]:
  """(model leaf, array) of the seeded random init (the whole model is built: for small models)."""
  import jax  # pylint: disable=import-outside-toplevel

  from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool import params  # pylint: disable=import-outside-toplevel
  from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel

  from flax import nnx  # pylint: disable=import-outside-toplevel

  model = model_lib.build_model(cfg, abstract=False)
  values = {params.leaf_key(tuple(map(str, path)), variable): variable.get_value()
            for path, variable in nnx.to_flat_state(nnx.state(model))}
  del model
  for leaf in leaves:
    yield leaf, jax.device_put(values.pop(leaf.key), restore.array_sharding(leaf.shape, mesh))


def _check_source(source: str) -> None:
  from inspect_tool import quantized_load  # pylint: disable=import-outside-toplevel

  if quantized_load.find_report(source):
    raise errors.InputError(f"source {source!r} is already an FP8 export; export from the float checkpoint")


# ---------------------------------------------------------------------------------------------------------------
# Export.


@dataclasses.dataclass(frozen=True)
class ExportResult:
  dst: str
  report: dict
  validation: Any  # export_report.Validation or None (skipped)

  @property
  def passed(self) -> bool:
    return self.validation is None or self.validation.passed


@contextlib.contextmanager
def _write_errors_raised():
  """Orbax logs a failed background write (e.g. disk full) with tracebacks from each of its threads, then
  raises it: the raised error becomes our one line, so those log records are not printed."""
  import logging  # pylint: disable=import-outside-toplevel

  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


def export(tokens: Sequence[str], dst: str, *, source: str | None = None, overwrite: bool = False, data=None,
           tokens_file: str | None = None, min_top1: float = export_report.DEFAULT_MIN_TOP1,
           run_validation: bool = True, mesh=None, command: str | None = None,
           read_group_bytes: int = READ_GROUP_BYTES, flush_bytes: int | None = None) -> ExportResult:
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
    flush_bytes: output bytes buffered per Orbax write (default `quant.export.DEFAULT_FLUSH_BYTES`).
  """
  tokens = list(tokens)
  cfg = config_lib.resolve_config(tokens)
  with destination.claim(dst, sources=[source], overwrite=overwrite) as claimed:
    return _export(cfg, tokens, claimed.path, source=source, overwrite=overwrite, data=data, tokens_file=tokens_file, min_top1=min_top1,
                   run_validation=run_validation, mesh=mesh, command=command, read_group_bytes=read_group_bytes,
                   flush_bytes=flush_bytes)


def _export(cfg, tokens, dst, *, source, overwrite, data, tokens_file, min_top1, run_validation, mesh, command,
            read_group_bytes, flush_bytes) -> ExportResult:
  """`export` once DST is claimed (checked against the inputs and locked)."""
  from inspect_tool import batch as batch_lib  # pylint: disable=import-outside-toplevel
  from inspect_tool import quantized_load  # pylint: disable=import-outside-toplevel
  from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel
  from quant import errors as quant_errors  # pylint: disable=import-outside-toplevel
  from quant import export as qexport  # pylint: disable=import-outside-toplevel

  if source is not None:
    _check_source(source)
  plan = plan_export(cfg)
  leaves = model_leaves(cfg)
  mesh = mesh if mesh is not None else restore.default_mesh()
  if run_validation and data is None:
    data = batch_lib.load_batch(None, None, vocab_size=cfg.vocab_size, max_target_length=cfg.max_target_length)
  copied, source_bytes = [], 0
  with atomic.atomic_directory(dst, overwrite=overwrite) as tmp:
    atomic.test_point("start")
    step_dir = os.path.join(tmp, str(export_report.STEP))
    writer = qexport.OrbaxStreamWriter(step_dir, item=export_report.ITEM,
                                       flush_bytes=flush_bytes or qexport.DEFAULT_FLUSH_BYTES)
    arrays = (_checkpoint_arrays(source, leaves, mesh, read_group_bytes) if source is not None
              else _init_arrays(cfg, leaves, mesh))
    try:
      with progress.step(f"exporting {len(leaves)} arrays ({len(plan.weights)} quantized)"), _write_errors_raised():
        for index, (leaf, array) in enumerate(arrays):
          source_bytes += _nbytes(leaf)
          out_key = tree.param_key(leaf.module_path)  # converter layout: everything under params/params
          wq = plan.weights.get(leaf.key)
          if wq is None:
            writer.add(out_key, array)
            copied.append(tree.Leaf(out_key, leaf.shape, leaf.dtype))
          else:
            qvalue, scale = qexport.quantize_weight(array, wq)
            writer.add(wq.qvalue_key, qvalue)
            writer.add(wq.scale_key, scale)
          del array
          if index == len(leaves) // 2:
            atomic.test_point("arrays", before=lambda: (writer.flush(), writer.wait()))
        writer.finalize()
    except BaseException as e:
      with contextlib.suppress(Exception):
        writer.wait()  # no background write may outlive the temporary directory
      if isinstance(e, quant_errors.QuantError):  # name the destination, not its temporary directory
        raise errors.InputError(str(e).replace(tmp, dst)) from None
      raise
    atomic.test_point("written")
    validation = None
    if run_validation:
      validation = export_report.validate(cfg, source, step_dir, data, min_top1=min_top1, mesh=mesh,
                                          tokens=tokens_file or "fixed")
    atomic.test_point("validated")
    report = export_report.build_report(plan, tokens=tokens, source=source, command=command, copied=copied,
                          source_bytes=source_bytes, written_bytes=writer.written_bytes,
                          mesh_devices=int(mesh.size), validation=validation)
    atomic.atomic_write_text(os.path.join(tmp, quantized_load.REPORT_NAME), json.dumps(report, indent=1) + "\n")
    atomic.test_point("report")
  return ExportResult(os.path.abspath(dst), report, validation)


class _LazyArrays:
  """Mapping leaf key -> array that restores each array from the checkpoint only when asked (one at a time)."""

  def __init__(self, source: str, leaves, mesh):
    from inspect_tool.checkpoint import orbax_metadata, restore  # pylint: disable=import-outside-toplevel

    self._listing = orbax_metadata.read_listing(source)
    self._pairs = {p.model.key: p for p in restore.plan(self._listing, leaves)}
    self._mesh = mesh

  def keys(self):
    return list(self._pairs)

  def __iter__(self):
    return iter(self._pairs)

  def __len__(self):
    return len(self._pairs)

  def __contains__(self, key):
    return key in self._pairs

  def __getitem__(self, key):
    from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel

    return restore.restore_pairs(self._listing, [self._pairs[key]], mesh=self._mesh)[key]


def export_deepseek_fp8(tokens: Sequence[str], dst: str, *, source: str | None = None, overwrite: bool = False,
                        mesh=None) -> dict:
  """`--layout deepseek-fp8`: DeepSeek-V3's FP8 release layout (HF safetensors, 128x128 block scales).

  The conversion is `export_hf.write_deepseek_fp8`; here the source arrays are read one at a time and the
  output directory appears only when complete. Its quantization is the release's, not the config's rules,
  and our model cannot load that layout, so there is no validation run.
  """
  from inspect_tool import export_hf  # pylint: disable=import-outside-toplevel
  from inspect_tool.checkpoint import restore  # pylint: disable=import-outside-toplevel

  cfg = config_lib.resolve_config(list(tokens))
  with destination.claim(dst, sources=[source], overwrite=overwrite) as claimed:
    if source is not None:
      _check_source(source)
    leaves = model_leaves(cfg)
    mesh = mesh if mesh is not None else restore.default_mesh()
    arrays = (_LazyArrays(source, leaves, mesh) if source is not None
              else {leaf.key: array for leaf, array in _init_arrays(cfg, leaves, mesh)})
    with atomic.atomic_directory(claimed.path, overwrite=overwrite) as tmp:
      with progress.step(f"writing DeepSeek FP8 safetensors ({len(leaves)} arrays)"):
        summary = export_hf.write_deepseek_fp8(arrays, cfg, tmp)
  summary = dict(summary, dst=claimed.path)
  summary.pop("config", None)
  return summary


