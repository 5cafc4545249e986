"""Export stages 3 and 4, quantize and write: every array into the Orbax checkpoint, in Qwix PTQ's layout.

Layout (Orbax, OCDBT + zarr3, the MaxText converter layout): `DST/0/items/params/params/<module path>/<name>`
for copied arrays, `.../<name>/array/qvalue` (float8_e4m3fn, the weight's shape) and `.../<name>/array/scale`
(the weight's rank, 1 on shared axes) for quantized ones — Qwix PTQ's layout, used for experts too. Scanned
stacks stay scanned (layer axis at `param_scan_axis`), so e.g. the experts `MoeBlock_0/wi_0` (X, L, E, F) get
a scale of shape (1, L, 1, F) and a dense `wq_b/kernel` (R, L, H, D) one of (1, L, H, D). Scales are stored in
the dtype the forward pass quantizes in (the compute dtype, bfloat16 by default): exactly Qwix PTQ's scales, and
exactly (in value) the float32 scales of the FP8 grouped matmul. Everything, the gate bias included, is written
under `params/params` (MaxText's params-only loaders find the bias there too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterable

from inspect_tool import atomic
from inspect_tool import tree
from inspect_tool.fp8_export import read


@dataclasses.dataclass(frozen=True)
class Written:
  """What `write_arrays` wrote: the copied leaves and the bytes read and written."""

  copied: list
  source_bytes: int
  written_bytes: int


@contextlib.contextmanager
def _write_errors_raised():
  """Orbax logs a failed background write (e.g. disk full) with tracebacks from each of its threads, then
  raises it: the raised error becomes our one line, so those log records are not printed."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    logger.setLevel(level)


def write_arrays(plan, arrays: Iterable[tuple[tree.Leaf, Any]], num_arrays: int, step_dir: str, *, item: str,
                 flush_bytes: int | None = None) -> Written:
  """Quantizes the planned weights among `arrays` ((model leaf, array) pairs) and writes all of them to `step_dir`.

  Raises:
    quant.errors.QuantError: a write failed (e.g. disk full) or a weight cannot be quantized.
  """
  from quant import ptq_weights  # pylint: disable=import-outside-toplevel

  writer = ptq_weights.OrbaxStreamWriter(step_dir, item=item,
                                         flush_bytes=flush_bytes or ptq_weights.DEFAULT_FLUSH_BYTES)
  copied, source_bytes = [], 0
  try:
    with _write_errors_raised():
      for index, (leaf, array) in enumerate(arrays):
        source_bytes += read.nbytes(leaf)
        out_key = tree.param_key(leaf.module_path)  # converter layout: everything under params/params
        wq = plan.weights.get(leaf.key)
        if wq is None:
          writer.add(out_key, array)
          copied.append(tree.Leaf(out_key, leaf.shape, leaf.dtype))
        else:
          qvalue, scale = ptq_weights.quantize_weight(array, wq)
          writer.add(wq.qvalue_key, qvalue)
          writer.add(wq.scale_key, scale)
        del array
        if index == num_arrays // 2:
          atomic.test_point("arrays", before=lambda: (writer.flush(), writer.wait()))
      writer.finalize()
  except BaseException:
    with contextlib.suppress(Exception):
      writer.wait()  # no background write may outlive the temporary directory
    raise
  return Written(copied, source_bytes, writer.written_bytes)
