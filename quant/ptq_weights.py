"""Post-training FP8 export, model-agnostic: which granularity a weight gets, its (qvalue, scale), the key layout,
and the one-line message of a failed write.

Granularity is what the quantized forward pass (Qwix QT) uses for the op that consumes the weight:

* `dot_general` / `einsum` (dense kernels, routers, heads): one scale per index of every axis the op does not
  contract (Qwix's channelwise default; `disable_channelwise_axes` makes it per-tensor);
* grouped matmuls (`gmm`, `ragged_dot`; rhs [G, K, N]): one scale per output column N, shared by all G experts
  (MaxText's Megablox granularity; `disable_channelwise_axes`: per-tensor).

A weight stored with extra axes that the op never sees as one operand (the layer axis of a scanned stack:
the op runs once per layer on a slice) keeps one scale per index of those axes too.

Numerics reproduce the forward pass bit for bit: the stored weight is first cast to the dtype the op consumes
(the layer's compute dtype, e.g. bfloat16 for a float32 kernel), then quantized with `quant.fp8.quantize`
(calibrated in that dtype; scale = absmax / finfo(qtype).max). The scale is stored in that dtype too, which is
what Qwix's PTQ produces for the same kernel and what the FP8 grouped matmul computes.

Key layout (Qwix PTQ's, for dense and expert weights alike): the float leaf `<key>` becomes
`<key>/array/qvalue` (the weight's shape, qtype) and `<key>/array/scale` (the weight's rank; 1 on every axis
that shares a scale).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from quant import calibration as calibration_lib
from quant import dequant_error
from quant import errors
from quant import fp8

ARRAY, QVALUE, SCALE = "array", "qvalue", "scale"
DENSE_OPS = ("dot_general", "einsum")
GROUPED_OPS = ("gmm", "ragged_dot")
QUANTIZE_CHUNK_BYTES = 32 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class WeightQuant:
  """How one stored weight is exported: its key, stored shape and the granularity of its scale."""

  key: tuple[str, ...]  # leaf key of the float weight
  shape: tuple[int, ...]  # stored shape (scanned stacks include the layer axis)
  channel_axes: tuple[int, ...]  # stored axes that keep one scale per index
  qtype: str  # numpy name, e.g. 'float8_e4m3fn'
  calibration: str = "absmax"
  compute_dtype: str = "bfloat16"  # dtype the forward pass quantizes in; also the scale's dtype
  kind: str = "dense"  # 'dense' (dot_general/einsum) or 'grouped' (gmm/ragged_dot)
  ops: tuple[str, ...] = ()  # the consuming ops, "module:op"

  @property
  def scale_shape(self) -> tuple[int, ...]:
    return tuple(d if i in self.channel_axes else 1 for i, d in enumerate(self.shape))

  @property
  def qvalue_key(self) -> tuple[str, ...]:
    return quantized_keys(self.key)[0]

  @property
  def scale_key(self) -> tuple[str, ...]:
    return quantized_keys(self.key)[1]

  def to_dict(self) -> dict[str, Any]:
    return {"key": "/".join(self.key), "shape": list(self.shape), "qtype": self.qtype,
            "scale_shape": list(self.scale_shape), "scale_dtype": self.compute_dtype,
            "channel_axes": list(self.channel_axes), "calibration": self.calibration, "kind": self.kind,
            "ops": list(self.ops)}


def quantized_keys(key: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(qvalue key, scale key) of a float leaf key."""
  key = tuple(key)
  return key + (ARRAY, QVALUE), key + (ARRAY, SCALE)


# ---------------------------------------------------------------------------------------------------------------
# Granularity.


def _check_rule(rule) -> None:
  tile = getattr(rule, "tile_size", None)
  if tile:
    raise errors.QuantError(f"rule {rule.module_path!r} uses tile_size={tile!r}; export supports channelwise "
                            "scales only (tile_size unset)")
  extra = getattr(rule, "additional_qt_config", None) or {}
  if extra.get("sparsity_rule") is not None:
    raise errors.QuantError(f"rule {rule.module_path!r} has a sparsity_rule; export supports dense weights only "
                            "(sparsity_rule None)")


def op_channel_axes(op_name: str, operand_ndim: int, contracting: Sequence[int], rule) -> tuple[int, ...]:
  """Axes of the weight operand (as the op consumes it) that keep their own scale under `rule` (Qwix QT)."""
  _check_rule(rule)
  if getattr(rule, "disable_channelwise_axes", False):
    return ()
  if op_name in GROUPED_OPS:
    if operand_ndim != 3:
      raise errors.QuantError(f"grouped op {op_name} has a weight of rank {operand_ndim}; accepted: [G, K, N]")
    return (2,)
  if op_name in DENSE_OPS:
    contracted = {a % operand_ndim for a in contracting}
    return tuple(a for a in range(operand_ndim) if a not in contracted)
  raise errors.QuantError(f"cannot export a weight consumed by {op_name}; accepted ops: "
                          f"{', '.join(DENSE_OPS + GROUPED_OPS)}")


def stored_channel_axes(local_axes: Sequence[int], operand_shape: Sequence[int], stored_shape: Sequence[int],
                        extra_axes: Sequence[int] = ()) -> tuple[int, ...]:
  """Maps channel axes of the op's operand onto the stored weight, whose `extra_axes` the op never sees.

  The stored shape without `extra_axes` must equal the operand's shape; each extra axis (e.g. a scanned
  stack's layer axis) keeps one scale per index.
  """
  stored_shape, operand_shape = tuple(stored_shape), tuple(operand_shape)
  extra = sorted({a % len(stored_shape) for a in extra_axes}) if stored_shape else []
  remaining = [a for a in range(len(stored_shape)) if a not in extra]
  if tuple(stored_shape[a] for a in remaining) != operand_shape:
    raise errors.QuantError(f"stored weight shape {stored_shape} does not reduce to the op's operand shape "
                            f"{operand_shape} by removing axes {tuple(extra)}; accepted: the op consumes the "
                            "stored weight as is (per layer in a scanned stack)")
  return tuple(sorted(set(extra) | {remaining[a] for a in local_axes}))


def extra_axes(operand_shape: Sequence[int], stored_shape: Sequence[int], preferred: int | None = None) -> tuple:
  """The single stored axis whose removal gives the operand's shape ((), if the shapes agree).

  With several candidates (equal neighbouring sizes) `preferred` wins if it is one of them.
  """
  operand_shape, stored_shape = tuple(operand_shape), tuple(stored_shape)
  if operand_shape == stored_shape:
    return ()
  if len(stored_shape) != len(operand_shape) + 1:
    raise errors.QuantError(f"stored weight shape {stored_shape} does not fit the op's operand shape "
                            f"{operand_shape}; accepted: equal, or one extra (layer) axis")
  candidates = [a for a in range(len(stored_shape)) if stored_shape[:a] + stored_shape[a + 1:] == operand_shape]
  if not candidates:
    raise errors.QuantError(f"stored weight shape {stored_shape} does not fit the op's operand shape "
                            f"{operand_shape}; accepted: equal, or one extra (layer) axis")
  return ((preferred,) if preferred in candidates else (candidates[0],))


# ---------------------------------------------------------------------------------------------------------------
# Numerics.


def _source_absmax(x, axes: tuple[int, ...], compute_dtype: str):
  """`fp8.absmax(x.astype(compute_dtype), axes)`, taken on `x` as it is and then cast: a float cast rounds
  monotonically, so the largest magnitude cast is the largest of the cast magnitudes, bit for bit. XLA then reads
  `x` where it quantizes instead of keeping the whole cast copy for two readers (on the CPU that copy is fresh pages
  at every call: a third of the quantizer's time)."""
  return fp8.absmax(x, axes).astype(compute_dtype)


@functools.partial(jax.jit, static_argnames=("qtype", "axes", "calibration", "compute_dtype"))
def _quantize(x, *, qtype: str, axes: tuple[int, ...], calibration: str, compute_dtype: str):
  if not gathers_absmax_calibration(calibration):
    return fp8.quantize(x.astype(compute_dtype), qtype, axes, calibration)
  amax = _source_absmax(x, axes, compute_dtype)
  return _quantize_with_absmax(x, amax, qtype=qtype, calibration=calibration, compute_dtype=compute_dtype)


@functools.partial(jax.jit, static_argnames=("axes", "compute_dtype"))
def _absmax(x, *, axes: tuple[int, ...], compute_dtype: str):
  return _source_absmax(x, axes, compute_dtype)


@functools.partial(jax.jit, static_argnames=("qtype", "calibration", "compute_dtype"))
def _quantize_with_absmax(x, amax, *, qtype: str, calibration: str, compute_dtype: str):
  scale = fp8.scale_from_absmax(amax, qtype, calibration)
  return fp8.quantize_with_scale(x.astype(compute_dtype), qtype, scale), scale


def as_qtype(qvalue, qtype, shape) -> np.ndarray:
  """A measured quantizer's qvalue as a numpy array of `qtype` and the block's `shape` (its bytes viewed as it,
  without a copy)."""
  qtype = fp8.resolve_qtype(qtype, integers=True)
  value = np.asarray(qvalue).reshape(shape)
  return value.view(qtype) if value.dtype != qtype else value


@functools.partial(jax.jit, static_argnames=("qtype", "axes", "calibration", "compute_dtype"))
def _quantize_measured(x, *, qtype: str, axes: tuple[int, ...], calibration: str, compute_dtype: str):
  if not gathers_absmax_calibration(calibration):
    qvalue, scale = _quantize(x, qtype=qtype, axes=axes, calibration=calibration, compute_dtype=compute_dtype)
    return dequant_error.as_bits(qvalue), scale, dequant_error.channel_figures(x, qvalue, scale)
  amax = _source_absmax(x, axes, compute_dtype)
  return _quantize_with_absmax_measured(x, amax, qtype=qtype, calibration=calibration, compute_dtype=compute_dtype)


# jax 0.10's XLA CPU pipeline drops optimization barriers: a measured quantizer that quantizes the whole slice and
# then takes the figures of its bytes quantizes twice there and holds the cast slice (201 MiB of temporaries for a
# 256 MiB slice), so there it quantizes inside the figures' run loop (`dequant_error.quantized_with_figures`). On
# jax 0.12 the loop costs more: 771 against 722 ms of CPU for a (160, 1, 1024, 1024) float32 slice, and the wide
# export of docs/benchmarks.md 19.0-20.0 s against 16.2-16.9 s (alternating rounds).
_WHOLE_THEN_FIGURES = jax.__version_info__ >= (0, 12)


@functools.partial(jax.jit, static_argnames=("qtype", "calibration", "compute_dtype"))
def _quantize_with_absmax_measured(x, amax, *, qtype: str, calibration: str, compute_dtype: str):
  scale = fp8.scale_from_absmax(amax, qtype, calibration)
  if _WHOLE_THEN_FIGURES:
    qvalue = fp8.quantize_with_scale(x.astype(compute_dtype), qtype, scale)
    bits = dequant_error.as_bits(qvalue)
    return bits, scale, dequant_error.channel_figures(x, bits, scale, qtype=qvalue.dtype)
  quantize = lambda run, s: fp8.quantize_with_scale(run.astype(compute_dtype), qtype, s)  # noqa: E731
  qvalue, figures = dequant_error.quantized_with_figures(x, scale, quantize)
  return qvalue, scale, figures


def gathers_absmax_calibration(calibration: str) -> bool:
  """Whether `calibration` takes its scales from an absmax (`absmax` or `absmax,<factor>`)."""
  return calibration_lib.parse_calibration(calibration)[0] == "absmax"


def gathers_absmax(wq: WeightQuant) -> bool:
  """Whether `wq`'s scales come from an absmax, so that a weight can be quantized in two passes over blocks that
  also cut the shared axes: the maximum of the blocks' absmaxes is the weight's (`compiled_quantizers`)."""
  return gathers_absmax_calibration(wq.calibration)


def _statics(wq: WeightQuant) -> dict:
  return dict(qtype=fp8.resolve_qtype(wq.qtype, integers=True).name, calibration=wq.calibration,
              compute_dtype=jnp.dtype(wq.compute_dtype).name)


def compiled_quantizers(shape, dtype, wq: WeightQuant, *, two_pass: bool, sharding=None,
                        measured: bool = False) -> tuple:
  """The quantizer of blocks of `shape` and `dtype` of the weight `wq`, compiled ahead of time (the executables
  the jitted calls would build, so bit for bit the same values): `(quantize,)`, x -> (qvalue, scale), as
  `quantize_weight` without chunks; or, `two_pass`, `(absmax, quantize_block)`: x -> absmax and
  (x, whole absmax) -> (qvalue, scale). `sharding`: where the blocks will be (default: the default device).
  `measured`: the quantizers also return the block's dequantization error per channel, computed in the same step
  (`quant.dequant_error.channel_figures`: (largest, sum), each of the scale's shape), and the qvalue as
  `dequant_error.quantized_with_figures` gives it back (`as_qtype` makes it the block's qtype and shape)."""
  spec = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)
  statics, axes = _statics(wq), tuple(wq.channel_axes)
  if not two_pass:
    return ((_quantize_measured if measured else _quantize).lower(spec, axes=axes, **statics).compile(),)
  amax_shape = tuple(d if i in axes else 1 for i, d in enumerate(shape))
  amax = jax.ShapeDtypeStruct(amax_shape, jnp.dtype(wq.compute_dtype), sharding=sharding)
  second = _quantize_with_absmax_measured if measured else _quantize_with_absmax
  return (_absmax.lower(spec, axes=axes, compute_dtype=statics["compute_dtype"]).compile(),
          second.lower(spec, amax, **statics).compile())


def quantize_weight(x, wq: WeightQuant, *, chunk_bytes: int = QUANTIZE_CHUNK_BYTES):
  """(qvalue, scale) of the stored weight `x` as `wq` says: cast to the compute dtype, then fp8 or int8 channelwise.

  Works on sharded `jax.Array`s; bit-identical however `x` is sharded (absmax and the elementwise steps do not
  depend on the order of reduction). A weight larger than `chunk_bytes` is quantized in slices along its
  largest channel axis (channels are independent, so the result is the same) to bound temporary memory.
  """
  if tuple(x.shape) != tuple(wq.shape):
    raise errors.QuantError(f"weight {'/'.join(wq.key)} has shape {tuple(x.shape)}; the plan expects {wq.shape}")
  x = jnp.asarray(x)
  kwargs = dict(axes=tuple(wq.channel_axes), **_statics(wq))
  nbytes = x.size * x.dtype.itemsize
  axes = [a for a in wq.channel_axes if x.shape[a] > 1]
  if nbytes <= chunk_bytes or not axes:
    return _quantize(x, **kwargs)
  axis = max(axes, key=lambda a: x.shape[a])
  bounds = np.linspace(0, x.shape[axis], min(x.shape[axis], -(-nbytes // chunk_bytes)) + 1).astype(int)
  parts = [_quantize(jax.lax.slice_in_dim(x, int(lo), int(hi), axis=axis), **kwargs)
           for lo, hi in zip(bounds[:-1], bounds[1:])]
  return (jnp.concatenate([q for q, _ in parts], axis=axis), jnp.concatenate([s for _, s in parts], axis=axis))


# ---------------------------------------------------------------------------------------------------------------
# Write errors.


_WRITE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                 errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                 errno.EROFS: "read-only file system"}
_WRITE_TEXTS = (("no space left", "no space left on device"), ("quota exceeded", "disk quota exceeded"),
                ("permission denied", "permission denied"), ("read-only file system", "read-only file system"))


def write_error(path: str, e: BaseException) -> errors.QuantError:
  """One-line error for a failed write of `path`, naming the OS reason when one is in the exception chain."""
  chain = errors.exception_chain(e)
  for exc in chain:
    if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
      return errors.QuantError(f"cannot write {path!r}: {_WRITE_ERRNOS[exc.errno]}")
  for exc in chain:
    text = str(exc).lower()
    for needle, reason in _WRITE_TEXTS:
      if needle in text:
        return errors.QuantError(f"cannot write {path!r}: {reason}")
  first = (str(chain[-1]).strip().splitlines() or [type(chain[-1]).__name__])[0][:300]
  return errors.QuantError(f"cannot write {path!r}: {first}")
