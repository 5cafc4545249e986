"""Traces which Qwix rule every intercepted op of an NNX model gets, without computing anything.

`trace_model(model, rules, *inputs, **kw)` runs `qwix.quantize_model` under `nnx.eval_shape` (abstract:
no weight memory, scanned stacks traced once) with a recording `QtProvider`. It records every op Qwix
intercepts (dot_general, einsum, ragged_dot, conv_general_dilated) with Qwix's own module path, per-module op
id and first-match rule, and also every `get_current_rule(op)` lookup (e.g. MaxText's Megablox "gmm"), which
Qwix matches but neither numbers nor logs: those get per-module ids `gmm0`, `gmm1`, ... in call order.

Each op is paired with the weight it consumes: an `nnx.Param` attribute of the op's module, found by object
identity or by following unary ops (astype, reshape, ...) back to it, as Qwix's `find_param` does (plus
Qwix's unique-shape fallback for dot_general and conv, not for einsum, whose activations could share a
shape with a Param). For a gmm lookup the weight is looked for among the local variables of the frames
between the lookup and the module's method.

Each record also keeps the weight operand as the op consumes it: its shape (inside a scanned stack, the
per-layer slice), its dtype (after the layer's cast), and the axes the op contracts (for a grouped op the
[G, K, N] convention gives (1,)). Quantization granularity and numerics follow from these (`quant.ptq_weights`).

FLOPs per token are a property of the weight, not of the traced shapes: 2 × (weight parameters one token
uses). A dense weight is used whole: 2 × params. A grouped (expert) weight of G groups is used for
`experts_per_token` groups: 2 × params × experts_per_token / G. `params` counts the weight as stored in the
model, so a scanned stack (traced once, per-layer slices inside the scan body) counts all its layers.

Recording never quantizes: intercepted ops run plain, and rule lookups answer None (what a model sees
outside Qwix, so it takes its plain path and no quantized kernel is traced); the recorded rule is what Qwix
would have answered. Which ops Qwix intercepts does not depend on that, because Qwix runs its handlers, and
kernels run their bodies, with interception switched off.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any, Sequence

from flax import nnx
import jax
import qwix

from quant import compat

GROUPED_OPS = ("ragged_dot", "gmm")


@dataclasses.dataclass(frozen=True)
class OpRecord:
  """One intercepted op (or rule lookup) as Qwix saw it, with the weight it consumes."""

  module: str  # Qwix module path, '/'-joined
  op: str  # per-module op id: dot_general0, einsum1, ragged_dot2, gmm0, ...
  op_name: str  # dot_general | einsum | ragged_dot | conv_general_dilated | gmm (or any looked-up name)
  rule: int | None  # index of the first matching rule, as Qwix picks it
  weight: str | None = None  # '/'-joined path of the nnx.Param consumed, None when no Param is involved
  weight_shape: tuple[int, ...] | None = None  # as stored in the model (scanned stacks include the layer axis)
  params: int = 0  # parameters of that weight as stored
  flops_per_token: int = 0  # 2 × weight parameters one token uses (see module docstring)
  matmul: bool = False  # a weight contraction (what quantization rules are about)
  lookup: bool = False  # a `get_current_rule` lookup, not an op Qwix intercepted itself
  lowering: bool = False  # a dot_general issued by JAX's own ragged_dot implementation, not by the model
  # The weight operand as the op consumes it (after casts; a per-layer slice inside a scanned stack):
  operand_shape: tuple[int, ...] | None = None
  operand_dtype: str | None = None  # e.g. 'bfloat16' when the layer casts a float32 weight before the op
  contracting: tuple[int, ...] | None = None  # axes of that operand the op contracts (grouped [G,K,N]: (1,))


@dataclasses.dataclass(frozen=True)
class Trace:
  """What one abstract forward pass under the rules showed."""

  rules: tuple[qwix.QtRule, ...]
  ops: tuple[OpRecord, ...]  # in first-call order, one per (module, op id); lowering artifacts included
  rule_matches: tuple[int, ...]  # Qwix's own per-rule match counters (ops and lookups)
  param_shapes: dict[str, tuple[int, ...]]  # every nnx.Param of the model, '/'-joined path -> shape
  provider: str | None = "qt"

  def visible_ops(self) -> tuple[OpRecord, ...]:
    """The ops a user should see: everything except JAX-internal lowering artifacts."""
    return tuple(op for op in self.ops if not op.lowering)


def trace_model(model: nnx.Module, rules: Sequence[qwix.QtRule], *inputs: Any, experts_per_token: int = 1,
                provider: str | None = "qt", method: str = "__call__", **input_kwargs: Any) -> Trace:
  """Runs `model.<method>(*inputs, **input_kwargs)` abstractly under `rules` and records every op.

  Args:
    model: an NNX model, concrete or abstract (e.g. from `nnx.eval_shape`); it is not modified.
    rules: Qwix rules, first match wins.
    *inputs: positional inputs of the forward pass (arrays or `jax.ShapeDtypeStruct`s).
    experts_per_token: routed experts per token, used for the FLOPs of grouped (expert) weights.
    provider: the provider whose semantics apply ('qt', 'nvidia_fp8', 'nanoo_fp8'); kept in the trace.
    method: the model method Qwix intercepts.
    **input_kwargs: keyword inputs of the forward pass.
  """
  shapes = param_shapes(model)
  recorder = _Recorder(list(rules), shapes, experts_per_token)

  def run(m, args, kwargs):
    qwix.quantize_model(m, recorder, *args, methods=(method,), **kwargs)

  nnx.eval_shape(run, model, list(inputs), dict(input_kwargs))
  ops, seen = [], set()
  for op in recorder.records:  # one record per (module, op id), as Qwix logs them (re-traces repeat ids)
    if (op.module, op.op) not in seen:
      seen.add((op.module, op.op))
      ops.append(op)
  return Trace(rules=tuple(rules), ops=tuple(ops), rule_matches=tuple(compat.provider_rule_matches(recorder)),
               param_shapes=shapes, provider=provider)


def param_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
  """Every `nnx.Param` of `model` as '/'-joined path -> shape (works on abstract models)."""
  out = {}
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    out["/".join(map(str, path))] = tuple(variable.shape)
  return out


class _Recorder(qwix.QtProvider):
  """A `QtProvider` that matches rules exactly as Qwix does, records each op, and runs it unquantized."""

  def __init__(self, rules: list[qwix.QtRule], shapes: dict[str, tuple[int, ...]], experts_per_token: int):
    super().__init__(rules)
    self.records: list[OpRecord] = []
    self._shapes = shapes
    self._experts_per_token = experts_per_token
    self._lookup_counts: dict[int, tuple[Any, dict[str, int]]] = {}

  # Interception points -------------------------------------------------------------------------------

  def get_intercept_map(self):
    intercepts = super().get_intercept_map()
    intercepts[compat.get_current_rule_intercept_key()] = self._lookup
    return intercepts

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                  out_sharding=None):
    rule, op_id = compat.provider_lookup(self, "dot_general")
    (lhs_contract, rhs_contract), _ = dimension_numbers
    self._record_op("dot_general", op_id, rule, [(lhs, lhs_contract), (rhs, rhs_contract)],
                    lowering=_inside_jax_ragged_dot())
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)

  def einsum(self, einsum_str, *operands, precision=None, preferred_element_type=None,
             _dot_general=jax.lax.dot_general, out_sharding=None):  # pylint: disable=invalid-name
    rule, op_id = compat.provider_lookup(self, "einsum")
    self._record_op("einsum", op_id, rule, _einsum_contractions(einsum_str, operands), by_shape=False)
    return jax.numpy.einsum(einsum_str, *operands, precision=precision,
                            preferred_element_type=preferred_element_type, _dot_general=_dot_general,
                            out_sharding=out_sharding)

  def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
    rule, op_id = compat.provider_lookup(self, "ragged_dot")
    module = compat.current_module()
    name = _find_param_name(module, rhs, by_shape=False)
    self._append(module, "ragged_dot", op_id, rule, name, grouped=True, operand=rhs, contracting=(1,))
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type, group_offset=group_offset)

  def conv_general_dilated(self, lhs, rhs, *args, **kwargs):
    rule, op_id = compat.provider_lookup(self, "conv_general_dilated")
    module = compat.current_module()
    self._append(module, "conv_general_dilated", op_id, rule, _find_param_name(module, rhs, by_shape=True),
                 operand=rhs)
    return jax.lax.conv_general_dilated(lhs, rhs, *args, **kwargs)

  def _lookup(self, op_name: str):
    """`get_current_rule(op_name)`: Qwix's only_rule match (counted, not numbered), recorded with an id."""
    rule, _ = compat.provider_lookup(self, op_name, only_rule=True)
    module = compat.current_module()
    _, counts = self._lookup_counts.setdefault(id(module), (module, {}))
    count = counts.get(op_name, 0)
    counts[op_name] = count + 1
    name, value = _find_lookup_weight(module, inspect.currentframe().f_back)
    grouped = op_name in GROUPED_OPS
    self._append(module, op_name, f"{op_name}{count}", rule, name, grouped=grouped, lookup=True, operand=value,
                 contracting=(1,) if grouped and value is not None else None)
    return None  # what a model sees outside Qwix: its plain (unquantized) path, like every op here

  # Recording -----------------------------------------------------------------------------------------

  def _record_op(self, op_name: str, op_id: str, rule, operands, lowering: bool = False,
                 by_shape: bool = True) -> None:
    module = compat.current_module()
    name, contracted, found, found_contract = None, False, None, None
    for shape_match in (False, True) if by_shape else (False,):  # identity, then Qwix's unique-shape heuristic
      for operand, contract in operands:
        name = _find_param_name(module, operand, by_shape=shape_match)
        if name is not None:
          contracted, found, found_contract = bool(contract), operand, tuple(int(a) for a in contract)
          break
      if name is not None:
        break
    self._append(module, op_name, op_id, rule, name, matmul=contracted, lowering=lowering, operand=found,
                 contracting=found_contract)

  def _append(self, module, op_name: str, op_id: str, rule, param_name: str | None, *, grouped: bool = False,
              lookup: bool = False, matmul: bool | None = None, lowering: bool = False, operand: Any = None,
              contracting: tuple[int, ...] | None = None) -> None:
    module_path = "/".join(map(str, module.qwix_path))
    index = next((i for i, r in enumerate(compat.provider_rules(self)) if r is rule), None)
    weight = shape = None
    params = flops = 0
    if param_name is not None:
      weight = f"{module_path}/{param_name}" if module_path else param_name
      local_shape = tuple(getattr(module, param_name).shape)
      shape = self._shapes.get(weight, local_shape)
      params = math.prod(shape)
      if grouped:
        groups = local_shape[0] if local_shape else 1
        flops = 2 * params * self._experts_per_token // max(groups, 1)
      else:
        flops = 2 * params
    if matmul is None:
      matmul = weight is not None
    if not matmul:
      flops = 0
    operand_shape = operand_dtype = None
    if weight is not None and operand is not None and hasattr(operand, "shape"):
      operand_shape = tuple(int(d) for d in operand.shape)
      operand_dtype = jax.numpy.dtype(operand.dtype).name
    else:
      contracting = None
    self.records.append(OpRecord(module=module_path, op=op_id, op_name=op_name, rule=index, weight=weight,
                                 weight_shape=shape, params=params, flops_per_token=flops, matmul=matmul,
                                 lookup=lookup, lowering=lowering, operand_shape=operand_shape,
                                 operand_dtype=operand_dtype, contracting=contracting))


# ---------------------------------------------------------------------------------------------------------
# Finding the weight an op consumes.

def _module_params(module) -> dict[str, Any]:
  return {name: node.get_value() for name, node in vars(module).items() if isinstance(node, nnx.Param)}


def _find_param_name(module, x: Any, *, by_shape: bool) -> str | None:
  """The name of the module's Param that `x` is (or is derived from by unary ops); shape match optional."""
  if not hasattr(x, "shape"):
    return None
  candidates = _module_params(module)
  by_id = {id(v): n for n, v in candidates.items()}
  seen = 0
  while x is not None and seen < 64:
    seen += 1
    if id(x) in by_id:
      return by_id[id(x)]
    source = compat.tracer_single_input(x)
    if source is not None:
      x = source
      continue
    const = compat.tracer_constant(x)
    if const is not None and id(const) in by_id:
      return by_id[id(const)]
    break
  if by_shape and x is not None:
    same = [n for n, v in candidates.items() if tuple(v.shape) == tuple(getattr(x, "shape", ()))]
    if len(same) == 1:
      return same[0]
  return None


def _find_lookup_weight(module, frame) -> tuple[str | None, Any]:
  """For a rule lookup: the first local (innermost frame first, `rhs` first) that is one of the module's Params.

  Returns (Param name, that local value) or (None, None).
  """
  while frame is not None:
    f_locals = frame.f_locals
    names = sorted(f_locals, key=lambda n: n != "rhs")
    for name in names:
      value = f_locals[name]
      if name == "self" or not hasattr(value, "shape") or len(getattr(value, "shape", ())) < 2:
        continue
      found = _find_param_name(module, value, by_shape=False)
      if found is not None:
        return found, value
    if f_locals.get("self") is module:
      return None, None
    frame = frame.f_back
  return None, None


def _einsum_contractions(einsum_str: str, operands: Sequence[Any]) -> list[tuple[Any, tuple[int, ...]]]:
  """(operand, axes it contracts) pairs: a letter contracted when absent from the output."""
  spec = einsum_str.replace(" ", "")
  if "->" in spec:
    inputs, output = spec.split("->")
  else:
    inputs = spec
    letters = re.sub(r"[^A-Za-z]", "", inputs)
    output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
  pairs = []
  for subscript, operand in zip(inputs.split(","), operands):
    letters = subscript.replace("...", "")
    pairs.append((operand, tuple(i for i, c in enumerate(letters) if c not in output)))
  return pairs


def _inside_jax_ragged_dot() -> bool:
  """True when the current dot_general comes from JAX's own ragged_dot implementation (CPU decomposition)."""
  frame = inspect.currentframe()
  while frame is not None:
    code = frame.f_code
    if "ragged_dot" in code.co_name and "/jax/" in code.co_filename.replace("\\", "/"):
      return True
    frame = frame.f_back
  return False

