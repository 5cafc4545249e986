"""Loads an export (`inspect_checkpoint export`, FP8 or int8) into the quantized model: Qwix PTQ + pre-quantized
experts.

The model is built abstractly and wrapped by `qwix.quantize_model` with a `PtqProvider` over the config's
rules (one abstract call under `nnx.eval_shape`), so every dense kernel a rule quantizes becomes
`<kernel>/array/{qvalue,scale}` (a `WithAux` of a `QArray`), exactly the layout the export wrote. PTQ does not
touch the routed experts (it never sees our grouped matmul as an op); every float Param that the checkpoint
stores as `array/qvalue` + `array/scale` (the experts) is replaced the same way here, and the MoE block hands
the pre-quantized weight to `quant.gmm.op.gmm`, which runs the FP8 grouped matmul on the stored values and scales
(activations quantized on the fly by the rule, as in the quantized forward pass), or with megablox=false to
`quant.gmm.op.prequantized_ragged_dot` (Qwix QT's quantized ragged_dot on the stored weight). Then the stored arrays are
restored onto the mesh and assigned.

An export is recognised by `exports.find_report`; the loaded model's config must carry the quantization keys it
was exported with (the error names them).
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import qwix

from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool.checkpoint import exports
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.checkpoint import restore
from inspect_tool.configuration import config as config_lib
from inspect_tool.coverage import trace as model_coverage
from inspect_tool.paramtree import params
from inspect_tool.storage import paths
from quant import compat
from quant import ptq_weights
from quant import rounding


def _ptq_template(cfg: config_lib.ModelConfig, rules):
  """The abstract model under Qwix PTQ: quantized dense kernels as WithAux(QArray) of abstract arrays."""
  def quantize(model):
    args, kwargs = model_lib.qwix_init_inputs(cfg)
    compat.exact_qwix_quantization(rounding.quotient, rounding.by_constant)  # activations on the fly, as on a CPU
    quantized = qwix.quantize_model(model, qwix.PtqProvider(list(rules)), *args, **kwargs)
    nnx.pop(quantized, nnx.Intermediate)
    return quantized

  return nnx.eval_shape(quantize, model_lib.build_model(cfg, abstract=True))


def _module_at(model, path: tuple[str, ...]):
  node = model
  for part in path:
    node = getattr(node, part)
  return node


def _prequantize_params(model, listing) -> list[tuple[str, ...]]:
  """Replaces each float Param the checkpoint stores quantized by an abstract WithAux(QArray); returns their keys."""
  stored = {l.key: l for l in listing.leaves}
  replaced = []
  for leaf in params.param_leaves(model):
    qkey, skey = ptq_weights.quantized_keys(leaf.key)
    if qkey not in stored or skey not in stored:
      continue
    qleaf, sleaf = stored[qkey], stored[skey]
    if qleaf.shape != leaf.shape:
      continue  # reported as a mismatch by the restore plan
    module = _module_at(model, leaf.module_path[:-1])
    qtype = jnp.dtype(qleaf.dtype)
    channel = [i for i, (s, d) in enumerate(zip(sleaf.shape, qleaf.shape)) if s == d and d > 1]
    array = qwix.QArray(qvalue=nnx.Param(jax.ShapeDtypeStruct(qleaf.shape, qtype)),
                        scale=nnx.Param(jax.ShapeDtypeStruct(sleaf.shape, jnp.dtype(sleaf.dtype))),
                        zero_point=None, qtype=qtype)
    setattr(module, leaf.module_path[-1], compat.ptq_weight(array, qtype, channel))
    replaced.append(leaf.key)
  return replaced


def load_quantized_model(cfg: config_lib.ModelConfig, path: str | locate.ResolvedPath, *, mesh=None):
  """The quantized model with the export's FP8 or int8 weights (see the module docstring), on `mesh`'s devices;
  `path` a checkpoint's, or the items' directory an export's writer resolved (read there, not located again).

  Raises:
    errors.InputError: the config has no quantization.
    errors.MismatchError: the checkpoint does not fit the quantized model (e.g. other quantize_* keys).
    errors.CheckpointError: the checkpoint cannot be read.
  """
  listed, path = path, (path.items_dir.rpartition("/")[0] if isinstance(path, locate.ResolvedPath) else path)
  rules = model_coverage.config_rules(cfg)
  if not rules:
    hint = exports.export_keys_hint(path) or "the quantization keys it was exported with"
    raise errors.InputError(f"checkpoint {path!r} is an {exports.label(path)}; load it into the quantized model: add "
                            f"{hint}")
  listing = orbax_metadata.read_listing(listed)
  model = _ptq_template(cfg, rules)
  _prequantize_params(model, listing)
  leaves = params.param_leaves(model, include_non_params=True)
  try:
    pairs = restore.plan(listing, leaves)
  except errors.MismatchError as e:
    hint = exports.export_keys_hint(path)
    raise errors.MismatchError(f"{e}; the export was made with: {hint}" if hint else str(e)) from None
  params.assign_arrays(model, restore.restore_pairs(listing, pairs, mesh=mesh))
  setattr(model, exports.MARK, paths.absolute(path))
  return model

