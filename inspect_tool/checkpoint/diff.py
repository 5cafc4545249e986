"""Compares a model's leaves with a checkpoint's: missing, unexpected and mis-shaped weights, and why.

Generic over `Leaf` lists (quantized `.../array/qvalue` keys compare like any other). MaxText layout
knowledge is limited to: the DeepSeek-V3 gate bias may sit under `params/params` or `nnx_aux/model`
(an alias, not a mismatch); training-only items (`opt_state`, `step`, RNG state) are ignored; and the
recognised causes below, each with a config suggestion.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Callable, Iterable

from inspect_tool.paramtree import tree

_UNSCANNED = re.compile(r"^(dense|moe)_layers_\d+$")
_SCANNED = ("dense_layers", "moe_layers")
_MTP_LAYER = re.compile(r"^mtp_layer_(\d+)$")
_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class Pair:
  """A model leaf and the checkpoint leaf stored for it."""

  model: tree.Leaf
  checkpoint: tree.Leaf

  def to_dict(self) -> dict:
    return {"key": self.model.dotted, "checkpoint_key": self.checkpoint.dotted,
            "model_shape": list(self.model.shape), "checkpoint_shape": list(self.checkpoint.shape),
            "model_dtype": self.model.dtype, "checkpoint_dtype": self.checkpoint.dtype}


@dataclasses.dataclass(frozen=True)
class Cause:
  """A recognised reason for the differences: `kind`, a sentence, and the config change that fixes it."""

  kind: str
  message: str
  suggestion: str = ""

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class DiffResult:
  """The comparison; `agree` means every model weight is present with its shape and dtype, and nothing else."""

  matched: list[Pair]
  missing: list[tree.Leaf]
  unexpected: list[tree.Leaf]
  shape_mismatches: list[Pair]
  dtype_mismatches: list[Pair]
  aliased: list[Pair]
  ignored: list[tree.Leaf]
  causes: list[Cause]
  conflicts: list[str] = dataclasses.field(default_factory=list)  # keys that compute differently (HF config.json)
  fix: str = ""  # a command, re-checked, under which model and checkpoint agree

  @property
  def loadable(self) -> bool:
    """Every model weight can be restored (the checkpoint may hold more)."""
    return not (self.missing or self.shape_mismatches or self.dtype_mismatches)

  @property
  def agree(self) -> bool:
    return self.loadable and not self.unexpected and not self.conflicts

  def summary(self, *, unexpected: bool = True) -> str:
    """One line: the counts with the first few keys, and the recognised causes' suggestions.

    `unexpected=False` leaves out checkpoint weights the model does not use (for loading, they do no harm).
    """
    if self.agree or (not unexpected and self.loadable and not self.conflicts):
      return f"model and checkpoint agree ({len(self.matched)} weights)"
    parts = []
    if self.conflicts:
      parts.append(f"{len(self.conflicts)} key(s) compute differently from the checkpoint's config "
                   f"({_first(self.conflicts)})")
    if self.missing:
      parts.append(f"{len(self.missing)} missing from checkpoint ({_first(l.dotted for l in self.missing)})")
    if self.unexpected and unexpected:
      parts.append(f"{len(self.unexpected)} not in model ({_first(l.dotted for l in self.unexpected)})")
    if self.shape_mismatches:
      parts.append(f"{len(self.shape_mismatches)} shape mismatch(es) ("
                   + _first(f"{p.model.dotted} model {p.model.shape} vs checkpoint {p.checkpoint.shape}"
                            for p in self.shape_mismatches) + ")")
    if self.dtype_mismatches:
      parts.append(f"{len(self.dtype_mismatches)} dtype mismatch(es) ("
                   + _first(f"{p.model.dotted} model {p.model.dtype} vs checkpoint {p.checkpoint.dtype}"
                            for p in self.dtype_mismatches) + ")")
    text = "; ".join(parts)
    fixes = [c.suggestion for c in self.causes if c.suggestion]
    if fixes:
      text += "; try " + " ".join(dict.fromkeys(fixes))
    return text

  def to_dict(self) -> dict:
    return {
        "agree": self.agree, "loadable": self.loadable, "matched": len(self.matched),
        "missing": [_leaf_dict(l) for l in self.missing],
        "unexpected": [_leaf_dict(l) for l in self.unexpected],
        "shape_mismatches": [p.to_dict() for p in self.shape_mismatches],
        "dtype_mismatches": [p.to_dict() for p in self.dtype_mismatches],
        "aliased": [p.to_dict() for p in self.aliased],
        "ignored": len(self.ignored),
        "causes": [c.to_dict() for c in self.causes],
        "conflicts": list(self.conflicts),
        "fix": self.fix or None,
    }


def _leaf_dict(leaf: tree.Leaf) -> dict:
  return {"key": leaf.dotted, "shape": list(leaf.shape), "dtype": leaf.dtype}


def _first(texts: Iterable[str]) -> str:
  texts = list(texts)
  more = f", +{len(texts) - _SHOWN} more" if len(texts) > _SHOWN else ""
  return ", ".join(texts[:_SHOWN]) + more


def is_training_only(leaf: tree.Leaf) -> bool:
  """Checkpoint leaves no model weight corresponds to: optimizer state, step counter, RNG state."""
  item = leaf.key[0]
  if item in ("opt_state", "step") or re.fullmatch(r"opt_state_\d+", item):
    return True
  return leaf.key[:2] == tree.AUX_PREFIX and "rngs" in leaf.key


def alias_keys(key: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
  """Where a checkpoint may store `key`: itself, then the other collection (params/params <-> nnx_aux/model)."""
  if key[:2] == tree.AUX_PREFIX:
    return key, tree.PARAMS_PREFIX + key[2:]
  if key[:2] == tree.PARAMS_PREFIX:
    return key, tree.AUX_PREFIX + key[2:]
  return (key,)


def diff_leaves(model_leaves: Iterable[tree.Leaf], ckpt_leaves: Iterable[tree.Leaf], *,
                ignore: Callable[[tree.Leaf], bool] = is_training_only) -> DiffResult:
  """Matches model leaves to checkpoint leaves by key (with the gate-bias alias) and explains differences."""
  model_leaves = tree.sort_leaves(model_leaves)
  ckpt_all = tree.sort_leaves(ckpt_leaves)
  ignored = [l for l in ckpt_all if ignore(l)]
  by_key = {l.key: l for l in ckpt_all if not ignore(l)}
  used: set[tuple[str, ...]] = set()
  matched, missing, shapes, dtypes, aliased = [], [], [], [], []
  for leaf in model_leaves:
    found = next((by_key[k] for k in alias_keys(leaf.key) if k in by_key and k not in used), None)
    if found is None:
      missing.append(leaf)
      continue
    used.add(found.key)
    pair = Pair(leaf, found)
    if found.key != leaf.key:
      aliased.append(pair)
    if found.shape != leaf.shape:
      shapes.append(pair)
    if found.dtype != leaf.dtype:
      dtypes.append(pair)
    if found.shape == leaf.shape and found.dtype == leaf.dtype:
      matched.append(pair)
  unexpected = [l for k, l in by_key.items() if k not in used]
  unexpected = tree.sort_leaves(unexpected)
  result = DiffResult(matched, missing, unexpected, shapes, dtypes, aliased, ignored, [])
  result.causes = _causes(result, model_leaves, list(by_key.values()))
  return result


def _segments(leaves: Iterable[tree.Leaf]) -> set[str]:
  return {part for leaf in leaves for part in leaf.key}


def _mtp_layers(leaves: Iterable[tree.Leaf]) -> int:
  found = [int(m.group(1)) for part in _segments(leaves) if (m := _MTP_LAYER.match(part))]
  return max(found, default=0)


def _stack_of(leaf: tree.Leaf) -> str | None:
  return next((part for part in leaf.key if part in _SCANNED), None)


def _scan_axis(leaves: Iterable[tree.Leaf]) -> int | None:
  """The layer axis (0 or 1) of scanned stacks' Params: the position where each stack's Params all agree."""
  stacks: dict[str, list[tuple[int, ...]]] = collections.defaultdict(list)
  for leaf in leaves:
    if leaf.is_param and len(leaf.shape) >= 2 and (stack := _stack_of(leaf)):
      stacks[stack].append(leaf.shape)
  axes = set()
  for shapes in stacks.values():
    same = [len({s[axis] for s in shapes}) == 1 for axis in (0, 1)]
    if same[0] != same[1]:
      axes.add(0 if same[0] else 1)
  return axes.pop() if len(axes) == 1 else None


def _causes(r: DiffResult, model: list[tree.Leaf], ckpt: list[tree.Leaf]) -> list[Cause]:
  causes = []
  model_seg, ckpt_seg = _segments(model), _segments(ckpt)
  missing_seg, unexpected_seg = _segments(r.missing), _segments(r.unexpected)
  if any(_UNSCANNED.match(s) for s in unexpected_seg) and missing_seg & set(_SCANNED):
    causes.append(Cause("scan_layers", "the checkpoint stores layers unscanned (moe_layers_0, ...) but the model "
                        "is scanned (moe_layers)", "scan_layers=false"))
  elif unexpected_seg & set(_SCANNED) and any(_UNSCANNED.match(s) for s in missing_seg):
    causes.append(Cause("scan_layers", "the checkpoint stores scanned layer stacks (moe_layers) but the model is "
                        "unscanned (moe_layers_0, ...)", "scan_layers=true"))

  ckpt_mtp, model_mtp = _mtp_layers(ckpt), _mtp_layers(model)
  if ckpt_mtp != model_mtp and any(_MTP_LAYER.match(p) for p in missing_seg | unexpected_seg):
    causes.append(Cause("mtp_num_layers", f"the checkpoint has {ckpt_mtp} MTP layer(s), the model {model_mtp}",
                        f"mtp_num_layers={ckpt_mtp}"))

  swapped = [p for p in r.shape_mismatches
             if len(p.model.shape) >= 2 and p.model.shape != p.checkpoint.shape
             and p.checkpoint.shape == (p.model.shape[1], p.model.shape[0]) + p.model.shape[2:]]
  if swapped and len(swapped) >= len(r.shape_mismatches) // 2:
    model_axis = _scan_axis(model)
    fix = f"param_scan_axis={1 - model_axis}" if model_axis is not None else ""
    causes.append(Cause("param_scan_axis", f"{len(swapped)} weight(s) differ by swapping axes 0 and 1 "
                        f"(e.g. {swapped[0].model.dotted}): the layer axis is stored at the other position", fix))

  causes.extend(_size_causes(r.shape_mismatches))
  causes.extend(_layer_count_causes(r.shape_mismatches, swapped, model))

  quant = lambda segs: "qvalue" in segs and "array" in segs  # noqa: E731
  if quant(ckpt_seg) and not quant(model_seg) and r.unexpected:
    causes.append(Cause("quantization", "the checkpoint holds quantized weights (.../array/qvalue, scale) and the "
                        "model does not: build the model with the quantization the checkpoint was exported with"))
  elif quant(model_seg) and not quant(ckpt_seg) and r.missing:
    causes.append(Cause("quantization", "the model expects quantized weights (.../array/qvalue) but the checkpoint "
                        "is not quantized: compare against the unquantized model"))

  dtype_pairs = collections.Counter((p.model.dtype, p.checkpoint.dtype) for p in r.dtype_mismatches)
  if len(dtype_pairs) == 1:
    (want, got), count = dtype_pairs.popitem()
    causes.append(Cause("weight_dtype", f"{count} weight(s) are {got} in the checkpoint but {want} in the model",
                        f"weight_dtype={got}" if got in ("float32", "bfloat16", "float16") else ""))

  if model and ckpt and not r.matched and not r.aliased and not r.shape_mismatches and not r.dtype_mismatches:
    hf = ckpt[0].key[0] in ("model", "lm_head")
    return [Cause("unrelated", "no weight name in common: the checkpoint is for another model or layout"
                  + (" (it looks like a Hugging Face checkpoint; convert it to MaxText's layout)" if hf else ""))]
  return causes


def _size_causes(shape_mismatches: list[Pair]) -> list[Cause]:
  causes = []
  for p in shape_mismatches:
    tail = p.model.key[-2:]
    if len(p.model.shape) != 2 or len(p.checkpoint.shape) != 2:
      continue
    if tail == ("token_embedder", "embedding"):
      vocab_axis, emb_axis = 0, 1
    elif tail == ("logits_dense", "kernel"):
      vocab_axis, emb_axis = 1, 0
    else:
      continue
    if p.model.shape[vocab_axis] != p.checkpoint.shape[vocab_axis]:
      causes.append(Cause("vocab_size", f"{p.model.dotted}: vocabulary {p.checkpoint.shape[vocab_axis]} in the "
                          f"checkpoint, {p.model.shape[vocab_axis]} in the model",
                          f"vocab_size={p.checkpoint.shape[vocab_axis]}"))
    if p.model.shape[emb_axis] != p.checkpoint.shape[emb_axis]:
      causes.append(Cause("emb_dim", f"{p.model.dotted}: embedding size {p.checkpoint.shape[emb_axis]} in the "
                          f"checkpoint, {p.model.shape[emb_axis]} in the model",
                          f"base_emb_dim={p.checkpoint.shape[emb_axis]}"))
  unique = {}
  for c in causes:
    unique.setdefault((c.kind, c.suggestion), c)
  return list(unique.values())


def _layer_count_causes(shape_mismatches: list[Pair], swapped: list[Pair], model: list[tree.Leaf]) -> list[Cause]:
  """Scanned stacks whose weights differ only in the layer axis: a different number of layers."""
  axis = _scan_axis(model)
  if axis is None:
    return []
  counts: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)
  for p in shape_mismatches:
    stack = _stack_of(p.model)
    if p in swapped or stack is None or not p.model.is_param or len(p.model.shape) != len(p.checkpoint.shape):
      continue
    differing = [i for i, (a, b) in enumerate(zip(p.model.shape, p.checkpoint.shape)) if a != b]
    if differing == [axis]:
      counts[stack].add((p.model.shape[axis], p.checkpoint.shape[axis]))
  model_layers = {stack: next((l.shape[axis] for l in model if _stack_of(l) == stack and l.is_param
                               and len(l.shape) >= 2), 0) for stack in _SCANNED}
  ckpt_layers = dict(model_layers)
  for stack, pairs in counts.items():
    if len(pairs) == 1:
      ckpt_layers[stack] = next(iter(pairs))[1]
  causes = []
  for stack in sorted(counts):
    if len(counts[stack]) != 1:
      continue
    (want, got), = counts[stack]
    if stack == "dense_layers":
      fix = f"first_num_dense_layers={got}"
    else:
      fix = f"base_num_decoder_layers={ckpt_layers['dense_layers'] + got}"
    causes.append(Cause("num_layers", f"the checkpoint has {got} {stack} layer(s), the model {want}", fix))
  return causes
