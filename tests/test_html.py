"""HTML module-tree pages: one self-contained document, compact arrays, parameter counts, labels."""

import html as html_std
import re

import jax.numpy as jnp
import pytest
import qwix
from flax import nnx

from inspect_tool.configuration import config
from inspect_tool import model as model_lib
from inspect_tool.paramtree import tree
from inspect_tool.report import html


class MoEBiasVar(nnx.Variable):
  pass


class MoeBlock(nnx.Module):

  def __init__(self, rngs):
    self.wi_0 = nnx.Param(jnp.zeros((4, 2, 4, 8)))
    self.gate = nnx.Linear(8, 4, use_bias=False, rngs=rngs)
    self.gate.bias = MoEBiasVar(jnp.zeros((2, 4)))
    self.rngs = rngs  # RNG state: not shown


class Decoder(nnx.Module):

  def __init__(self, rngs):
    self.decoder_norm = nnx.RMSNorm(8, rngs=rngs)
    self.moe_layers = nnx.Dict(MoeBlock_0=MoeBlock(rngs))
    self.dropout = nnx.Dropout(0.0)  # no variables: left out unless labelled


class Mtp(nnx.Module):

  def __init__(self, decoder, rngs):
    self.decoder = decoder  # a second reference: shown once, under `decoder`
    self.mtp_1_projection = nnx.Linear(16, 8, use_bias=False, param_dtype=jnp.bfloat16, rngs=rngs)


class Transformer(nnx.Module):

  def __init__(self, rngs):
    self.decoder = Decoder(rngs)
    self.mtp_block = Mtp(self.decoder, rngs)


def _abstract_model():
  return nnx.eval_shape(lambda: Transformer(nnx.Rngs(0)))


def _text(page: str) -> str:
  """The page with tags removed and entities decoded: what a reader could see when all is open."""
  return html_std.unescape(re.sub(r"<[^>]+>", "", page))


def test_page_is_one_self_contained_document():
  page = html.render_model_html(_abstract_model(), title="tiny <model>")
  assert page.startswith("<!DOCTYPE html>")
  assert page.count("<html") == 1 and page.rstrip().endswith("</html>")
  assert "<title>tiny &lt;model&gt;</title>" in page
  assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
  assert "@import" not in page


def test_modules_show_class_names_param_counts_and_compact_arrays():
  text = _text(html.render_model_html(_abstract_model(), title="t"))
  # 256 (wi_0) + 32 (gate kernel) + 8 (norm) + 128 (projection); the bias and RNGs are not params.
  assert "Transformer( # 424 params" in text
  assert "decoder=Decoder( # 296 params" in text
  assert "MoeBlock_0=MoeBlock( # 288 params" in text
  assert "wi_0=f32[4,2,4,8]" in text
  assert "bias=MoEBiasVar f32[2,4]" in text
  assert "kernel=bf16[16,8]" in text
  assert "mtp_block=Mtp( # 128 params" in text
  assert "ShapeDtypeStruct" not in text
  assert "rngs" not in text and "dropout" not in text


def test_shared_submodule_appears_once():
  text = _text(html.render_model_html(_abstract_model(), title="t"))
  assert text.count("decoder_norm=RMSNorm(") == 1


def test_real_arrays_render_like_abstract_ones():
  text = _text(html.render_model_html(Transformer(nnx.Rngs(0)), title="t"))
  assert "wi_0=f32[4,2,4,8]" in text and "Transformer( # 424 params" in text


def test_annotations_label_modules_including_ones_without_params():
  labels = {"decoder/moe_layers/MoeBlock_0": "rule 0 (fp8 e4m3)", "decoder/dropout": "unquantized",
            "": "model"}
  text = _text(html.render_model_html(_abstract_model(), title="t", annotations=labels))
  assert "MoeBlock_0=MoeBlock( # 288 params · rule 0 (fp8 e4m3)" in text
  assert "dropout=Dropout() # 0 params · unquantized" in text
  assert "Transformer( # 424 params · model" in text


def test_deepseek3_tiny_tree_has_every_module_once_and_the_listing_total():
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1"])
  labels = {"decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0": "rule 0 (fp8 e4m3)"}
  text = _text(html.render_model_html(model_lib.build_model(cfg, abstract=True), title="t", annotations=labels))
  assert re.search(r"Transformer\( # 34M params", text)  # 34,004,896 in MaxText's listing
  assert re.search(r"MoeBlock_0=\w+\( # 11.5M params · rule 0 \(fp8 e4m3\)", text)
  assert "wi_0=f32[16,58,64,64]" in text and "wi_0=f32[16,64,64]" in text  # scanned, and the MTP layer
  assert "bias=MoEBiasVar f32[58,16]" in text
  assert re.search(r"mtp_block=\w+\(", text) and re.search(r"mtp_1_transformer_layer=\w+\(", text)
  assert text.count("decoder_norm=") == 1 and "rngs" not in text


def test_annotation_on_an_array_is_refused():
  with pytest.raises(ValueError, match="decoder/decoder_norm/scale is an array"):
    html.render_model_html(_abstract_model(), title="t", annotations={"decoder/decoder_norm/scale": "x"})


def test_quantized_weights_show_their_stored_type():

  class Quantized(nnx.Module):

    def __init__(self):
      self.kernel = nnx.Param(qwix.QArray(qvalue=jnp.zeros((8, 4), jnp.float8_e4m3fn),
                                          scale=jnp.ones((1, 4), jnp.float32)))

  text = _text(html.render_model_html(Quantized(), title="t"))
  assert "kernel=QArray f8_e4m3fn[8,4]" in text and "Quantized( # 32 params" in text


def test_leaves_nest_by_key_and_count_params_only_under_params():
  leaves = [
      tree.Leaf(tree.param_key(("decoder", "moe_layers", "wi_0")), (16, 3, 64, 64), "float32"),
      tree.Leaf(tree.param_key(("decoder", "decoder_norm", "scale")), (64,), "bfloat16"),
      tree.Leaf(tree.aux_key(("decoder", "moe_layers", "gate", "bias")), (3, 16), "float32"),
      tree.Leaf(("step",), (), "int64"),
  ]
  page = html.render_leaves_html(leaves, title="ckpt")
  text = _text(page)
  assert "wi_0: f32[16,3,64,64]" in text
  assert "scale: bf16[64]" in text
  assert "bias: f32[3,16]" in text
  assert "step: i64[]" in text
  assert "decoder: { # 197K params" in text  # 196,672 under params.params.decoder
  assert "nnx_aux: { # 48 values" in text
  assert "<h1>ckpt</h1>" in page


def test_leaves_without_params_prefix_all_count_as_params():
  leaves = [tree.Leaf(("model", "layers", "0", "mlp", "gate_proj", "weight"), (8, 4), "bfloat16"),
            tree.Leaf(("lm_head", "weight"), (16, 4), "bfloat16")]
  text = _text(html.render_leaves_html(leaves, title="hf"))
  assert "{ # 96 params" in text and "weight: bf16[8,4]" in text and "0: { # 32 params" in text


def test_short_type_and_human_count():
  assert html.short_type((7168, 3, 18432), "float32") == "f32[7168,3,18432]"
  assert html.short_type((), "uint32") == "u32[]"
  assert html.short_type((2,), "float8_e4m3fn") == "f8_e4m3fn[2]"
  assert html.short_type((2,), "bool") == "bool[2]"
  assert [html.human_count(n) for n in (7, 7168, 1_234_567, 671_026_419_712)] == [
      "7", "7.17K", "1.23M", "671B"]


def test_deep_unscanned_tree_renders_every_layer():
  """Rendering time is measured by bench/bench_cli.py (671B unscanned --html), not here."""
  leaves = [
      tree.Leaf(tree.param_key(("decoder", f"moe_layers_{i}", "self_attention", f"w{j}", "kernel")),
                (7168, 1536), "float32")
      for i in range(61) for j in range(20)
  ]
  page = html.render_leaves_html(leaves, title="big")
  assert all(f"moe_layers_{i}" in page for i in (0, 30, 60)) and "w19" in page


def test_tables_above_the_tree_are_escaped_and_labels_get_their_colours():
  colors = html.distinct_colors([f"rule {i}" for i in range(12)] + ["unquantized"], neutral=("unquantized",))
  assert len(set(colors.values())) == 13 and colors["unquantized"] == html.NEUTRAL
  table = html.Table("legend <b>", ("label", "meaning"), (("rule 0", "a|b <script>"),), swatches=(colors["rule 0"],))
  page = html.render_model_html(_abstract_model(), title="t", annotations={"decoder": "rule 0"}, colors=colors,
                                tables=(table,))
  tables = page[page.index("<table"):page.index('<div class="total">')]
  assert "<caption>legend &lt;b&gt;</caption>" in tables and "a|b &lt;script&gt;" in tables
  assert "<script>" not in tables
  assert f'class="swatch" style="background-color:{colors["rule 0"]}"' in page
  assert page.index("legend &lt;b&gt;") < page.index("treescope")
  assert f"background-color:{colors['rule 0']};border-radius" in page  # the badge on `decoder`
