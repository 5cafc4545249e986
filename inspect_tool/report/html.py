"""Self-contained HTML pages of a parameter tree, drawn with treescope.

Both entry points first build one small tree of `_Node` (a module or key prefix) and `_Array` (a
weight) records, then let treescope draw it: each array shows compactly as `f32[7168,3,18432]`, each
node names its class (for a model) and carries a `# 1.23M params` comment plus an optional label
(the quantization rule that won its ops). Only `nnx.Param` weights (a checkpoint's `params.params`
arrays) count as parameters; a subtree without any counts its other arrays' elements (`# 48 values`).
"""

from __future__ import annotations

import dataclasses
import html
import math
import re

from flax import nnx
from treescope import rendering_parts
import treescope

from inspect_tool.paramtree import tree

# Taller than treescope's notebook default (20 lines): the page is the whole report, so a scanned
# DeepSeek model opens fully; deep unscanned stacks stay folded beyond this many lines.
_MAX_OPEN_LINES = 400
_TARGET_WIDTH = 100
_ABBREVIATE = 1  # a folded node lists its children as `{<...>}` instead of inlining whole subtrees


@dataclasses.dataclass(frozen=True)
class _Array:
  """One array; `kind` names a model variable type other than `Param` (`MoEBiasVar`)."""

  shape: tuple[int, ...]
  dtype: str
  is_param: bool = True
  kind: str = ""
  spec: str = ""  # with `--devices`: MaxText's PartitionSpec and the per-device shard type

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def __treescope_repr__(self, path, subtree_renderer):
    del path, subtree_renderer
    parts = [rendering_parts.text(short_type(self.shape, self.dtype))]
    if self.kind:
      parts.insert(0, rendering_parts.custom_text_color(rendering_parts.text(f"{self.kind} "), "#6a1b9a"))
    if self.spec:
      parts.append(rendering_parts.custom_text_color(rendering_parts.text(f"  {self.spec}"), "#00695c"))
    return rendering_parts.build_one_line_tree_node(rendering_parts.siblings(*parts))


@dataclasses.dataclass
class _Node:
  """A module (or, for a checkpoint, a key prefix) and what it holds, keyed by attribute name."""

  path: str
  type_name: str = ""
  label: str = ""
  color: str = ""  # the label's badge colour (default: treescope's colour for the label's text)
  children: dict = dataclasses.field(default_factory=dict)
  params: int = 0
  values: int = 0

  def child(self, name: str) -> _Node:
    path = f"{self.path}/{name}" if self.path else name
    node = self.children.get(name)
    if node is None:
      node = self.children[name] = _Node(path=path)
    elif not isinstance(node, _Node):
      raise ValueError(f"{path} is an array, not a module or key prefix")
    return node

  def finish(self) -> None:
    """Sorts children naturally (`layers_2` before `layers_10`) and sums counts bottom-up."""
    self.children = dict(sorted(self.children.items(), key=lambda kv: tree.natural_key(kv[0])))
    self.params = self.values = 0
    for value in self.children.values():
      if isinstance(value, _Node):
        value.finish()
        self.params += value.params
        self.values += value.values
      else:
        self.values += value.size
        if value.is_param:
          self.params += value.size

  @property
  def count(self) -> str:
    if self.params or not self.values:
      return f"{human_count(self.params)} params"
    return f"{human_count(self.values)} values"

  @property
  def holds_only_arrays(self) -> bool:
    return not any(isinstance(value, _Node) for value in self.children.values())

  def _comment(self):
    """`# 1.23M params` in comment grey, then the label (if any) as a badge in the label's own color."""
    parts = [rendering_parts.comment_color(rendering_parts.text(f" # {self.count}"))]
    if self.label:
      color = self.color or treescope.formatting_util.color_from_string(self.label)
      parts += [rendering_parts.comment_color(rendering_parts.text(" · ")), rendering_parts.custom_style(
          rendering_parts.text(self.label), f"background-color:{color};border-radius:3px;padding:0 0.5ch")]
    return rendering_parts.siblings(*parts)

  def __treescope_repr__(self, path, subtree_renderer):
    del path
    typed = bool(self.type_name)
    children = []
    for i, (name, value) in enumerate(self.children.items()):
      last = i == len(self.children) - 1
      comma = (rendering_parts.fold_condition(expanded=rendering_parts.text(",")) if last else
               rendering_parts.siblings(",", rendering_parts.fold_condition(collapsed=rendering_parts.text(" "))))
      children.append(rendering_parts.build_full_line_with_annotations(rendering_parts.siblings_with_annotations(
          f"{name}=" if typed else f"{name}: ", subtree_renderer(value, path=None), comma)))
    comment = self._comment()
    prefix = rendering_parts.siblings(
        rendering_parts.qualified_type_name_style(rendering_parts.text(self.type_name)) if typed else "",
        "(" if typed else "{")
    return rendering_parts.build_foldable_tree_node_from_children(
        prefix=prefix,
        children=children,
        suffix=rendering_parts.siblings(")" if typed else "}",
                                        rendering_parts.fold_condition(collapsed=comment)),
        path=self.path or None,
        first_line_annotation=comment,
        # Open every module that holds modules; one holding only arrays stays on one line if it fits.
        expand_state=(rendering_parts.ExpandState.WEAKLY_COLLAPSED if self.holds_only_arrays
                      else rendering_parts.ExpandState.WEAKLY_EXPANDED),
    )


_DTYPE = re.compile(r"(float|uint|int|complex)(\d+)")
_KIND = {"float": "f", "uint": "u", "int": "i", "complex": "c"}


def short_type(shape, dtype: str) -> str:
  """JAX's short form of an array type: `f32[7168,3]`, `bf16[]`, `f8_e4m3fn[16,64]`."""
  name = str(dtype)
  if name == "bfloat16":
    name = "bf16"
  elif name.startswith("float8_"):
    name = "f8_" + name[len("float8_"):]
  else:
    match = _DTYPE.fullmatch(name)
    if match:
      name = _KIND[match.group(1)] + match.group(2)
  return f"{name}[{','.join(str(int(d)) for d in shape)}]"


def human_count(count: int) -> str:
  """`64`, `7.17K`, `1.23M`, `671B`: three significant digits above a thousand."""
  for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
    if count >= scale:
      return f"{count / scale:.3g}{suffix}"
  return str(count)


def _spec_label(sharding, names, is_param: bool, dtype: str) -> str:
  placement = sharding.placements.get(".".join(tree.param_key(names) if is_param else tree.aux_key(names)))
  return f"{placement.spec_text()} → {short_type(placement.shard_shape, dtype)}" if placement else ""


def _model_tree(model, annotations, sharding=None, colors=None) -> _Node:
  """Modules and non-RNG variables of an NNX model, each at its first (canonical) path."""
  root = _Node(path="", type_name=type(model).__name__)
  modules = {}
  for path, node in nnx.iter_graph(model):
    names = tuple(str(p) for p in path)
    if any(name.startswith("_pytree__") for name in names):
      continue
    if isinstance(node, nnx.Variable) and not isinstance(node, nnx.RngState):
      is_param = isinstance(node, nnx.Param)
      shape, dtype, wrapper = _describe(node.get_value())
      kind = " ".join(k for k in ("" if is_param else type(node).__name__, wrapper) if k)
      spec = _spec_label(sharding, names, is_param, dtype) if sharding is not None else ""
      _walk(root, names[:-1]).children[names[-1]] = _Array(shape, dtype, is_param, kind, spec)
    elif isinstance(node, nnx.Module) and names:
      modules[names] = type(node).__name__
  _label(root, annotations, colors)
  for names, type_name in modules.items():  # modules without variables or a label stay out
    node = _find(root, names)
    if node is not None:
      node.type_name = type_name
  return root


def _describe(value) -> tuple[tuple[int, ...], str, str]:
  """Shape, dtype and wrapper name of a variable's value: an array, a ShapeDtypeStruct or a Qwix
  `QArray` (its stored `qvalue` type) / `WithAux` (its inner array)."""
  wrapper = ""
  if hasattr(value, "array") and hasattr(value, "how"):  # qwix WithAux
    value = value.array
  if hasattr(value, "qvalue"):  # qwix QArray: `dtype` is the scale's, the weight is `qvalue`
    value, wrapper = value.qvalue, "QArray"
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    return tuple(int(d) for d in value.shape), str(value.dtype), wrapper
  return (), type(value).__name__, wrapper


def _leaves_tree(leaves) -> _Node:
  """Leaves nested by key. Arrays under `params.params` are parameters; in a listing without that
  prefix (safetensors, a value-wrapped decode checkpoint) every array is."""
  everything = not any(leaf.is_param for leaf in leaves)
  root = _Node(path="")
  for leaf in leaves:
    _walk(root, leaf.key[:-1]).children[leaf.key[-1]] = _Array(
        tuple(leaf.shape), leaf.dtype, everything or leaf.is_param)
  return root


def _walk(root: _Node, names) -> _Node:
  node = root
  for name in names:
    node = node.child(name)
  return node


def _find(root: _Node, names) -> _Node | None:
  node = root
  for name in names:
    node = node.children.get(name)
    if not isinstance(node, _Node):
      return None
  return node


def _label(root: _Node, annotations, colors=None) -> None:
  for path, label in (annotations or {}).items():
    # A path the tree lacks is added, so that no label is lost.
    node = _walk(root, tuple(name for name in path.split("/") if name))
    node.label, node.color = label, (colors or {}).get(label, "")


# Light background colours that stay apart from one another (and from the grey of "unquantized").
PALETTE = ("#a5d6a7", "#90caf9", "#ffcc80", "#ce93d8", "#80deea", "#fff59d", "#f48fb1", "#bcaaa4", "#c5e1a5",
           "#b39ddb", "#ffab91", "#80cbc4")
NEUTRAL = "#e0e0e0"


def distinct_colors(labels, neutral=()) -> dict[str, str]:
  """A colour per label: the palette's colours in the labels' order (cycling past 12), grey for `neutral` ones."""
  out, i = {}, 0
  for label in dict.fromkeys(labels):
    if label in neutral:
      out[label] = NEUTRAL
    else:
      out[label], i = PALETTE[i % len(PALETTE)], i + 1
  return out


@dataclasses.dataclass(frozen=True)
class Table:
  """A small table shown above the tree (e.g. the rule coverage at a glance)."""

  caption: str
  header: tuple[str, ...]
  rows: tuple[tuple[str, ...], ...]
  swatches: tuple[str, ...] = ()  # per row: a colour shown as a swatch in the first cell ("" for none)


def _table_html(table: Table) -> str:
  head = "".join(f"<th>{html.escape(h)}</th>" for h in table.header)
  body = []
  for i, row in enumerate(table.rows):
    cells = [html.escape(c) for c in row]
    color = table.swatches[i] if i < len(table.swatches) else ""
    if color and cells:
      cells[0] = f'<span class="swatch" style="background-color:{html.escape(color)}"></span>{cells[0]}'
    body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
  return (f'<table class="info"><caption>{html.escape(table.caption)}</caption>\n<thead><tr>{head}</tr></thead>\n'
          f"<tbody>\n" + "\n".join(body) + "\n</tbody></table>\n")


def _page(root: _Node, title: str, tables=()) -> str:
  root.finish()
  with treescope.active_autovisualizer.set_scoped(None), \
      treescope.abbreviation_threshold.set_scoped(_ABBREVIATE), \
      treescope.using_expansion_strategy(max_height=_MAX_OPEN_LINES, target_width=_TARGET_WIDTH):
    body = treescope.render_to_html(root, roundtrip_mode=False, compressed=False)
  heading = html.escape(title)
  return (
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      f"<title>{heading}</title>\n"
      "<style>body{font-family:sans-serif;margin:1.5em} h1{font-size:1.3em}"
      " .total{color:#555;margin-bottom:1em}"
      " table.info{border-collapse:collapse;margin-bottom:1em;font-size:0.9em}"
      " table.info caption{text-align:left;font-weight:bold;padding:0.3em 0}"
      " table.info th,table.info td{border:1px solid #ccc;padding:0.15em 0.6em;text-align:left}"
      " .swatch{display:inline-block;width:1em;height:1em;border-radius:3px;margin-right:0.5ch;"
      "vertical-align:middle}</style>\n</head>\n<body>\n"
      f"<h1>{heading}</h1>\n" + "".join(_table_html(t) for t in tables)
      + f"<div class=\"total\">{html.escape(root.count)}</div>\n"
      f"{body}\n</body>\n</html>\n")


def render_model_html(model, *, title: str, annotations: dict[str, str] | None = None, sharding=None,
                      colors: dict[str, str] | None = None, tables=()) -> str:
  """The module tree of an NNX model (abstract or real) as one self-contained HTML page.

  Args:
    model: an `nnx.Module`; arrays may be `jax.ShapeDtypeStruct`s (from `nnx.eval_shape`).
    title: page title and heading.
    annotations: module path (`decoder/moe_layers/DeepSeekMoeBlock_0`, `""` for the root) to a short
      label shown on that module's node, e.g. the quantization rule that won its ops.
    sharding: a `sharding.placement.ShardingPlan`: each leaf shows its spec and shard type beside it.
    colors: label → CSS colour of its badge (e.g. `distinct_colors`); others get treescope's colour.
    tables: `Table`s shown between the heading and the tree (a summary, a legend).
  """
  return _page(_model_tree(model, annotations, sharding, colors), title, tables)


def render_leaves_html(leaves: list[tree.Leaf], *, title: str) -> str:
  """A checkpoint listing as the same kind of page, nested by the leaves' keys."""
  return _page(_leaves_tree(leaves), title)
