"""The one module that reaches into private APIs of Qwix, Orbax, JAX and Python's `re` (all else uses public APIs).

Each accessor imports what it needs when first called and, when the installed version does not have it,
raises `CompatError`: one line naming the package, its installed version, the missing name and the versions
this project was tested with. Nothing here is imported at start-up beyond the standard library.

Private names used, and why no public API does the job (Qwix 0.1.8, Orbax 0.12.8, JAX 0.10.2 / 0.12.0.1):
* `qwix._src.interception.disable_interceptions`: runs our kernels without Qwix intercepting their inner ops
  (Qwix's own handlers use it).
* `qwix._src.qconfig.get_current_rule`: the name under which a provider intercepts rule lookups (coverage).
* `qwix._src.utils.flax_util.get_current_module`: the module whose op a provider is handling (coverage).
* `qwix._src.core.sparsity.SparsityRule`, `qwix._src.core.dot_general_qt.DotGeneralQtConfig`: the fields a
  rule file may set.
* `qwix._src.core.qarray.HowToQuantize`, `qwix._src.providers.ptq.WithAux`: an abstract PTQ weight (loading
  an FP8 export).
* Orbax's v1 PyTree handler class name, written into a step's metadata (export).
* `QuantizationProvider._get_current_rule_and_op_id`, `._rules`, `._rule_matches`: the rule a provider matches
  for an op, and its rule counts (coverage, FP8 providers).
* JAX tracer internals (`parent.in_tracers`, `get_const`): which Param a traced value came from (coverage).
* `jax.experimental.pallas.ops.tpu.megablox.gmm` (the module; the package attribute of that name is the
  custom-VJP op): the Megablox `gmm` / `tgmm` kernels.
* Qwix's assertion text "lhs and rhs cannot be both weights" (`qwix._src.providers.qt`), turned into one line.
* `jax._src.lru_cache.LRUCache.put` (and `_CACHE_SUFFIX`, `_is_local_filesystem`): JAX's persistent compilation
  cache writes an entry in place; `atomic_compilation_cache_writes` makes it a temporary file renamed into place.
* numpy's `_core.multiarray._set_madvise_hugepage` (the switch numpy's release notes name; its only other control is
  an environment variable read at import): no transparent-huge-page advice for a streaming export's short-lived
  arrays. A numpy without it is left as it is (a speed setting; nothing depends on it).
* `qwix._src.core.qarray.compute_scale_zero_point`, `quantize_with_scale_zero_point` (and `call_with_generic_broadcast`,
  `numerics`): replaced by versions that divide as `quant.rounding` does (`exact_qwix_quantization`), so a TPU
  quantizes on the fly as a CPU does; Qwix has no hook for its division.
* Python's regular-expression parser (`re._parser`, `re._constants`): the only way to walk a pattern's syntax tree
  (`safe_regex` bounds the patterns a rule file may give).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import re
import uuid

from quant import errors

TESTED = {"qwix": "0.1.8", "orbax-checkpoint": "0.12.8", "jax": "0.10.2, 0.12.0.1", "numpy": "2.4.6, 2.5.5"}

GET_CURRENT_RULE = "qwix._src.qconfig.get_current_rule"  # Qwix's intercept-map key for rule lookups
ORBAX_PYTREE_HANDLER = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
MEGABLOX_KERNELS = "jax.experimental.pallas.ops.tpu.megablox.gmm"
SPLASH_KERNEL = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"
SPLASH_MASK = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask"


class CompatError(errors.QuantError):
  """The installed version of a dependency lacks a private API this project uses."""


def installed_version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "(not installed)"


def private(module_name: str, attr: str | None = None, *, package: str):
  """`module_name.attr` (or the module), else CompatError naming the installed and tested versions."""
  try:
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
  except (ImportError, AttributeError):
    name = module_name if attr is None else f"{module_name}.{attr}"
    raise CompatError(f"{package} {installed_version(package)} has no {name}, which this tool needs; accepted: "
                      f"{package} {TESTED[package]} (tested)") from None


def regex_internals():
  """Python's regular-expression parser and its constants modules (`re._parser`, `re._constants`)."""
  try:
    return re._parser, re._constants  # pylint: disable=protected-access
  except AttributeError:
    raise CompatError("this Python has no re._parser, which this tool needs to check rule patterns; accepted: "
                      "Python 3.11, 3.12 (tested)") from None


# Qwix ------------------------------------------------------------------------------------------------------


def disable_interceptions(fn):
  """`fn` run with Qwix's interception switched off (Qwix's own handlers do the same)."""
  return private("qwix._src.interception", "disable_interceptions", package="qwix")(fn)


def get_current_rule_intercept_key() -> str:
  """The intercept-map key under which a provider answers rule lookups (checked to exist)."""
  module_name, attr = GET_CURRENT_RULE.rsplit(".", 1)
  private(module_name, attr, package="qwix")
  return GET_CURRENT_RULE


def current_module():
  """The Flax module whose op the running Qwix provider is handling."""
  return private("qwix._src.utils.flax_util", "get_current_module", package="qwix")()


def sparsity_rule_class():
  return private("qwix._src.core.sparsity", "SparsityRule", package="qwix")


def dot_general_qt_config_class():
  return private("qwix._src.core.dot_general_qt", "DotGeneralQtConfig", package="qwix")


def ptq_weight(array, qtype, channelwise_axes):
  """A Qwix PTQ weight (`WithAux`) holding the QArray `array`, quantized per `channelwise_axes` with absmax."""
  how_class = private("qwix._src.core.qarray", "HowToQuantize", package="qwix")
  with_aux = private("qwix._src.providers.ptq", "WithAux", package="qwix")
  how = how_class(qtype=qtype, channelwise_axes=channelwise_axes, tiled_axes={}, calibration_method="absmax")
  return with_aux(array, how)


_EXACT_QWIX = []  # the originals, once the patch is in


def exact_qwix_quantization(quotient, by_constant) -> None:
  """Makes Qwix's on-the-fly quantization divide with `quotient(x, scale)` and `by_constant(x, c)` (callers pass
  `quant.rounding`'s: as XLA divides on a CPU, on every backend), so that the same inputs get the same codes on a
  TPU as on a CPU (on a TPU v5e the emulated quotients are a CPU's bit for bit: `tests/test_rounding.py`; without
  this, Qwix's own division rounds as the TPU does). Patches, once per process, `qwix._src.core.qarray.
  compute_scale_zero_point` (the absmax scale) and `quantize_with_scale_zero_point` (the quotient); other
  calibrations, zero points, noise and Qwix's reciprocal switch keep Qwix's own code."""
  if _EXACT_QWIX:
    return
  qarray = private("qwix._src.core.qarray", package="qwix")
  numerics = private("qwix._src.core.numerics", package="qwix")
  scale_fn = private("qwix._src.core.qarray", "compute_scale_zero_point", package="qwix")
  quantize_fn = private("qwix._src.core.qarray", "quantize_with_scale_zero_point", package="qwix")
  broadcast = private("qwix._src.core.qarray", "call_with_generic_broadcast", package="qwix")
  # lazy: JAX, ~0.6 s to import: `orbax --path`, `hf --path` load this module without it
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def compute_scale_zero_point(calibration, qtype):
    if "absmax" not in calibration or "min" in calibration or qtype in ("mxfp8", "mxfp4", "nvfp4"):
      return scale_fn(calibration, qtype)
    scale = by_constant(calibration["absmax"], float(numerics.get_symmetric_bound(qtype)))
    tiny_sqrt = jnp.sqrt(jnp.finfo(scale.dtype).tiny)
    return jnp.where(scale < tiny_sqrt, jnp.ones_like(scale), scale), None

  def quantize_with_scale_zero_point(array, qtype, scale, zero_point, noise_fn=None):
    if zero_point is not None or noise_fn is not None or getattr(qarray, "USE_RECIPROCAL_FOR_QUANTIZATION", False) \
        or not numerics.should_quantize(array.dtype):
      return quantize_fn(array, qtype, scale, zero_point, noise_fn)
    scale = scale.astype(array.dtype)
    qvalue = broadcast(quotient, array, scale)
    return qarray.QArray(numerics.convert_to(qvalue, qtype), scale, None, qtype)

  _EXACT_QWIX.extend((scale_fn, quantize_fn))
  qarray.compute_scale_zero_point = compute_scale_zero_point
  qarray.quantize_with_scale_zero_point = quantize_with_scale_zero_point


# JAX -------------------------------------------------------------------------------------------------------


def tracer_single_input(x):
  """The one input of the op that made tracer `x` (JAX tracer internals), or None."""
  # lazy: JAX, ~0.6 s to import: `orbax --path`, `hf --path` load this module without it
  import jax  # pylint: disable=import-outside-toplevel

  parent = getattr(x, "parent", None) if isinstance(x, jax.core.Tracer) else None
  inputs = getattr(parent, "in_tracers", None)
  return inputs[0] if inputs is not None and len(inputs) == 1 else None


def tracer_constant(x):
  """The constant a tracer stands for, when JAX knows it, else None."""
  # lazy: JAX, ~0.6 s to import: `orbax --path`, `hf --path` load this module without it
  import jax  # pylint: disable=import-outside-toplevel

  get_const = getattr(x, "get_const", None) if isinstance(x, jax.core.Tracer) else None
  return get_const() if get_const is not None else None


def megablox_kernels():
  """JAX's Megablox kernel module (`gmm`, `tgmm`, both with `interpret=`)."""
  module = private(MEGABLOX_KERNELS, package="jax")
  for attr in ("gmm", "tgmm"):
    private(MEGABLOX_KERNELS, attr, package="jax")
  return module


def splash_attention():
  """JAX's Pallas splash attention: (kernel module: `make_splash_mha`, `BlockSizes`, `SegmentIds`; mask module:
  `CausalMask`, `MultiHeadMask`)."""
  kernel, mask = private(SPLASH_KERNEL, package="jax"), private(SPLASH_MASK, package="jax")
  for attr in ("make_splash_mha", "BlockSizes", "SegmentIds"):
    private(SPLASH_KERNEL, attr, package="jax")
  for attr in ("CausalMask", "MultiHeadMask"):
    private(SPLASH_MASK, attr, package="jax")
  return kernel, mask


def _provider_attr(provider, name: str):
  value = getattr(provider, name, None)
  if value is None:
    raise CompatError(f"qwix {installed_version('qwix')} providers have no {name}, which this tool needs; "
                      f"accepted: qwix {TESTED['qwix']} (tested)")
  return value


def provider_lookup(provider, op_name: str, **kwargs):
  """(rule, op_id) a Qwix provider matches for the `op_name` op being intercepted (Qwix's protected lookup)."""
  return _provider_attr(provider, "_get_current_rule_and_op_id")(op_name, **kwargs)


def provider_rule(provider, op_name: str):
  """The rule a Qwix provider matches for the `op_name` op being intercepted, or None."""
  return provider_lookup(provider, op_name)[0]


def provider_rules(provider) -> list:
  """A Qwix provider's rules as it matches them."""
  return _provider_attr(provider, "_rules")


def provider_rule_matches(provider) -> list:
  """How many ops each of a Qwix provider's rules has matched."""
  return _provider_attr(provider, "_rule_matches")


QWIX_BOTH_WEIGHTS = "lhs and rhs cannot be both weights"


@contextlib.contextmanager
def qwix_weight_detection_errors():
  """Qwix's QT provider asserts when it takes both operands of a matmul for weights (it traces an operand back to
  the module's Params, and falls back to matching shapes), which some toy configs trigger; MaxText stops the same
  way. That assertion becomes one line."""
  try:
    yield
  except AssertionError as e:
    if QWIX_BOTH_WEIGHTS not in str(e):
      raise
    raise errors.QuantError(
        f"Qwix {installed_version('qwix')} took an activation of this model for a weight ('{QWIX_BOTH_WEIGHTS}'; "
        "it traces operands back to a module's Params and falls back to matching shapes, and MaxText stops the same "
        "way); accepted: other sizes (batch, tokens, widths) that do not coincide with a weight's") from None


def numpy_huge_page_advice(enabled: bool) -> None:
  """Sets whether numpy advises the kernel to back arrays of 4 MiB and more with transparent huge pages; a numpy
  without the switch is left as it is."""
  try:
    switch = private("numpy._core.multiarray", "_set_madvise_hugepage", package="numpy")
  except CompatError:
    return
  switch(bool(enabled))


def atomic_compilation_cache_writes() -> None:
  """JAX's file cache writes a compiled program in place (`LRUCache.put`), so a run killed or out of disk space
  mid-write leaves a truncated entry that every later run warns about and never replaces. Without eviction (JAX's
  default) on a local file system, an entry is written to a temporary file and renamed into place instead; other
  cases keep JAX's own `put`."""
  cache_class = private("jax._src.lru_cache", "LRUCache", package="jax")
  suffix = private("jax._src.lru_cache", "_CACHE_SUFFIX", package="jax")
  is_local = private("jax._src.lru_cache", "_is_local_filesystem", package="jax")
  original = cache_class.put
  if getattr(original, "atomic_writes", False):
    return

  def put(self, key: str, value: bytes) -> None:
    if not key or getattr(self, "eviction_enabled", True) or not is_local(str(self.path)):
      return original(self, key, value)
    path = os.path.join(str(self.path), f"{key}{suffix}")
    if os.path.exists(path):
      return None
    part = os.path.join(str(self.path), f".part-{uuid.uuid4().hex}")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's mode, as JAX's own write
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(value)
      os.replace(part, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(part)
      raise
    return None

  put.atomic_writes = True
  cache_class.put = put
