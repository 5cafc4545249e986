"""`rules` at a glance: the verdict per group (quantized / all, types, or why not) against MaxText's own Qwix traces,
exact shares, `--strict`'s verdict line, Markdown cells that a Markdown parser reads back unchanged."""

import collections
import functools
import html.parser as html_parser
import pathlib
import re

import pytest
from markdown_it import MarkdownIt

import maxtext_listings
from inspect_tool import cli
from inspect_tool.configuration import config
from inspect_tool.coverage import trace as coverage
from inspect_tool.report import coverage_format, coverage_report, glance_format
from conftest import DATA

QWIX = pathlib.Path(DATA) / "qwix"
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "quantization=fp8_full"]
LINE = re.compile(r"\[QWIX(?:-only_rule)?\] module='([^']+)' op=(\w+) rule=(\w+)")
QTYPE = re.compile(r"(weight|act|bwd)_qtype=(?:<class 'jax\.numpy\.(\w+)'>|None)")


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


@functools.lru_cache(maxsize=None)
def _report(*keys, rules=None):
  return coverage.trace_coverage(config.resolve_config(list(keys)), rules)


def _maxtext_rules(quantize_mtp):
  """MaxText's rules as its log printed them: [(module_path regex, {field: qtype name or None})]."""
  rules = []
  for line in (QWIX / f"deepseek3-tiny_quantize_mtp_{quantize_mtp}_rules.txt").read_text().splitlines():
    path = re.search(r"module_path='([^']*)'", line).group(1)
    rules.append((path, {field: name for field, name in QTYPE.findall(line)}))
  return rules


def _short(name):
  match = re.fullmatch(r"float\d+_(e\dm\d)(fn)?", name or "")
  return match.group(1) if match else (name or "none")


def _group(module, op):
  """The verdict group of a module in MaxText's trace, from its path alone (independent of the tool's classifier)."""
  if module.startswith("mtp_block/"):
    return "MTP block"
  if module == "decoder/logits_dense":
    return "head"
  if module.startswith("decoder/dense_layers/"):
    return "dense stack"
  if module.endswith("/MoeBlock_0/gate"):
    return "router"
  if "/shared_experts/" in module:
    return "shared experts"
  if module.endswith("/MoeBlock_0"):
    return f"routed experts {op}"
  assert module.startswith("decoder/moe_layers/self_attention/"), module
  return "MoE attention"


def _expected_verdicts(quantize_mtp):
  """{group: (quantized, all, types)} from MaxText's [QWIX] logs, gmm lookups, rules and parameter listing."""
  rules = _maxtext_rules(quantize_mtp)
  experts = sorted({key.split(".")[-1] for key, shape, _ in maxtext_listings.entries("deepseek3-tiny_scan_mtp1.txt")
                    if ".MoeBlock_0." in key and len(shape) == 4})
  assert experts == ["wi_0", "wi_1", "wo"]
  weights = {}  # (module, weight) -> winning rules of its ops
  for name in ("", "_gmm_lookups"):
    for line in (QWIX / f"deepseek3-tiny_quantize_mtp_{quantize_mtp}{name}.txt").read_text().splitlines():
      module, op, rule = LINE.match(line).groups()
      rule = None if rule == "None" else int(rule)
      if op.startswith("dot_general"):  # every dot_general MaxText logs consumes its module's kernel
        weights.setdefault((module, "kernel"), []).append(rule)
      elif op == "gmm":  # one lookup line per MoeBlock: it runs for each expert weight
        for expert in experts:
          weights.setdefault((module, expert), []).append(rule)
  expected = {}
  for (module, weight), won in weights.items():
    group = _group(module, weight)
    quantizing = [rules[r][1] for r in won if r is not None and rules[r][1]["weight"]]
    done, total, types = expected.get(group, (0, 0, set()))
    types |= {" · ".join(_short(q[f]) for f in ("weight", "act", "bwd")) for q in quantizing}
    expected[group] = (done + bool(quantizing), total + 1, types)
    if not quantizing:  # MaxText's rules leave it out: no regex of theirs matches the module
      assert not any(re.fullmatch(path, module) for path, _ in rules)
  return {group: (done, total, tuple(sorted(types))) for group, (done, total, types) in expected.items()}


@pytest.mark.parametrize("quantize_mtp", ["true", "false"])
def test_verdicts_equal_what_maxtext_qwix_trace_shows(quantize_mtp):
  report = _report(*TINY, f"quantize_mtp={quantize_mtp}")
  ours = {v.name: (v.quantized, v.weights, tuple(sorted(v.types))) for v in report.glance}
  assert ours == _expected_verdicts(quantize_mtp)
  assert [v.name for v in report.glance] == [
      "dense stack", "MoE attention", "router", "routed experts wi_0", "routed experts wi_1", "routed experts wo",
      "shared experts", "MTP block", "head"]
  assert coverage_format.to_json_data(report)["summary"]["glance"] == [
      {"name": v.name, "weights": v.weights, "quantized_weights": v.quantized, "types": list(v.types),
       "reasons": list(v.reasons)} for v in report.glance]
  reasons = {v.name: v.reasons for v in report.glance if v.quantized < v.weights}
  mtp = {"MTP block": ("quantize_mtp=false",)} if quantize_mtp == "false" else {}
  assert reasons == {**mtp, "head": ("quantize_logits_proj=false",)}


@pytest.mark.parametrize("quantize_mtp", ["true", "false"])
def test_text_opens_with_the_verdicts_within_100_columns(quantize_mtp):
  report = _report(*TINY, f"quantize_mtp={quantize_mtp}")
  lines = coverage_format.to_text(report).splitlines()
  block = lines[2:lines.index("Rules:") - 1]
  assert block[0].startswith("At a glance") and all(len(line) <= 100 for line in block)
  expected = _expected_verdicts(quantize_mtp)
  for name, (done, total, types) in expected.items():
    row = next(line for line in block if line.startswith(f"  {name}  "))
    assert row.split()[len(name.split())] == f"{done}/{total}"
    assert (" / ".join(types) in row) if done == total else ("not quantized:" in row)
  assert not re.search(r"\bgmm\d", coverage_format.to_text(report))


def test_partly_quantized_groups_show_exact_counts_and_never_round_up_to_100(tmp_path):
  """One small dense weight left out by an all-None rule: 19/20 decoder weights, 99.96% of their parameters."""
  rules = tmp_path / "rules.yml"
  rules.write_text("- module_path: 'decoder/dense_layers/self_attention/wq_a'\n  weight_qtype: null\n"
                   "- module_path: 'decoder/.*layers.*'\n  op_names: [dot_general, gmm]\n"
                   "  weight_qtype: float8_e4m3fn\n  act_qtype: float8_e4m3fn\n  bwd_qtype: float8_e5m2\n")
  report = _report(*TINY, rules=str(rules))
  dense = next(v for v in report.glance if v.name == "dense stack")
  assert (dense.quantized, dense.weights, dense.reasons) == (7, 8, ("rule 0 has no weight type",))
  decoder = next(g for g in report.groups if g.group == "decoder")
  assert (decoder.quantized_weights, decoder.weights) == (19, 20) and 0.999 < decoder.params_share < 1
  text = coverage_format.to_text(report)
  shares = text.split("Quantized share of matmul weights:")[1].splitlines()
  row = next(line for line in shares if line.startswith("  decoder "))
  assert "19/20" in row and "100.0%" not in row and ">99.9%" in row
  assert "7/8" in next(line for line in text.splitlines() if line.startswith("  dense stack "))


def test_reasons_name_the_op_a_rule_leaves_out_and_the_key_that_decides():
  int8 = {v.name: v for v in _report("model_name=deepseek3-tiny", "mtp_num_layers=1", "quantization=int8",
                                     "quantize_router_proj=false").glance}
  assert int8["routed experts wo"].status == "not quantized: gmm: rule 1 names only dot_general"
  assert int8["router"].status == "not quantized: quantize_router_proj=false (rule 0 has no weight type)"
  assert int8["MTP block"].reasons == ("no rule matches (quantization=int8 covers decoder/.*layers.* only)",
                                      "quantize_router_proj=false (rule 0 has no weight type)")  # its gate
  assert int8["dense stack"].status == "int8 · int8 · int8"
  off = _report("model_name=deepseek3-tiny").glance
  assert {v.status for v in off if v.weights} == {"not quantized: no rules (quantization is off)"}
  assert next(v for v in off if v.name == "MTP block").status == "no MTP block (mtp_num_layers=0)"


@pytest.mark.parametrize("keys,groups", [
    (["model_name=deepseek4-tiny"], ["MoE attention", "MoE indexer", "MoE compressors", "router",
                                     "routed experts wi_0", "routed experts wi_1", "routed experts wo",
                                     "shared experts", "MTP block", "head", "hyper head (hc_head)"]),
    (["model_name=deepseek3.2-671b", "mtp_num_layers=1", "quantize_mtp=true"],
     ["dense stack", "dense stack indexer", "MoE attention", "MoE indexer", "router", "routed experts wi_0",
      "routed experts wi_1", "routed experts wo", "shared experts", "MTP block", "head"]),
])
def test_v32_and_v4_groups(keys, groups):
  report = _report(*keys, "quantization=fp8_full")
  assert [v.name for v in report.glance] == groups
  assert sum(v.weights for v in report.glance) == report.total.weights
  assert sum(v.quantized for v in report.glance) == report.total.quantized_weights
  for v in report.glance:
    for reason in v.reasons:  # an "op: rule i names only ..." reason holds under Qwix's matching
      match = re.fullmatch(r"(\w+): rule (\d+) names only (.*)", reason)
      if match:
        rule = report.rules[int(match.group(2))].rule
        assert match.group(1) not in rule.op_names and ", ".join(rule.op_names) == match.group(3)
  if keys[0] == "model_name=deepseek4-tiny":  # the grouped output projection o_a_proj is an einsum
    attention = next(v for v in report.glance if v.name == "MoE attention")
    assert attention.reasons == ("einsum: rule 0 names only dot_general, gmm, ragged_dot",)
    assert attention.weights - attention.quantized == sum("o_a_proj" in w.weight for w in report.unquantized_weights)
  assert all(len(line) <= 100 for line in glance_format.glance_text(report.glance))


def _maxtext_decoder_weights():
  """Decoder matmul weights in MaxText's quantize_mtp=true trace: kernels of decoder dot_generals, 3 per gmm."""
  lines = (QWIX / "deepseek3-tiny_quantize_mtp_true.txt").read_text().splitlines()
  kernels = {LINE.match(l).group(1) for l in lines if "op=dot_general" in l}
  gmm = (QWIX / "deepseek3-tiny_quantize_mtp_true_gmm_lookups.txt").read_text().splitlines()
  return (sum(m.startswith("decoder/") and m != "decoder/logits_dense" for m in kernels)
          + 3 * sum("module='decoder/" in l for l in gmm))


def test_strict_prints_its_verdict_when_it_passes_and_when_it_fails(capsys, tmp_path):
  code, _, err = run(capsys, "rules", *TINY, "quantize_mtp=true", "--strict")
  weights = _maxtext_decoder_weights()
  assert code == 0 and err.strip().splitlines() == [
      f"strict: passed: {weights}/{weights} decoder matmul weights quantized, every rule used "
      "(not required: mtp, head)"]
  code, _, err = run(capsys, "rules", *TINY[:2], "quantization=int8", "--strict", "--format", "json")
  last = err.strip().splitlines()[-1]
  assert code == 1 and last == (f"strict: FAILED: {weights - 3}/{weights} decoder matmul weights quantized, "
                                "0 unused rule(s) (not required: mtp, head); exit 1")
  assert len(err.strip().splitlines()) == 4  # three expert weights, then the verdict
  assert "gmm(wo)" in err and not re.search(r"gmm\d", err)
  code, out, err = run(capsys, "rules", *TINY)
  assert code == 0 and err == "" and "strict" not in out


# Markdown ------------------------------------------------------------------------------------------------------

def _tables(markdown):
  """Each table as (header cells, body rows) as markdown-it-py (GFM tables) reads them: the cells' plain text."""
  tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
  tables, row, in_head = [], None, False
  for token in tokens:
    if token.type == "table_open":
      tables.append(([], []))
    elif token.type == "thead_open":
      in_head = True
    elif token.type == "tbody_open":
      in_head = False
    elif token.type == "tr_open":
      row = []
    elif token.type == "tr_close":
      (tables[-1][0].extend(row) if in_head else tables[-1][1].append(row))
    elif token.type == "inline" and row is not None:
      row.append("".join(c.content for c in token.children or ()))
    elif token.type == "table_close":
      row = None
  return tables


def _raw_cells(line):
  return len(re.split(r"(?<!\\)\|", line.strip()[1:-1]))


@pytest.mark.parametrize("keys", [TINY + ["quantize_mtp=true"], TINY[:2] + ["quantization=int8"]])
def test_markdown_tables_read_back_unchanged(keys):
  report = _report(*keys)
  markdown = coverage_format.to_markdown(report)
  tables = _tables(markdown)
  assert len(tables) == 4  # at a glance, rules, ops, summary
  for header, rows in tables:
    assert all(len(r) == len(header) for r in rows)
  blocks = re.findall(r"(?:^\|.*\n)+", markdown, flags=re.M)
  assert len(blocks) == 4
  for block in blocks:  # in the source too: no cell is split by an unescaped `|`
    assert len({_raw_cells(line) for line in block.splitlines()}) == 1, block
  assert [_raw_cells(block.splitlines()[0]) for block in blocks] == [len(header) for header, _ in tables]
  glance, rules, ops, _ = tables
  assert glance[1] == [[v.name, v.count, " / ".join(v.types) if v.quantized else "", "; ".join(v.reasons)]
                       for v in report.glance]
  assert [r[1] for r in rules[1]] == [row.rule.module_path for row in report.rules]
  assert [r[:2] for r in ops[1]] == [[op.module, coverage_report.op_label(op)] for op in report.ops]
  if "quantize_mtp=true" in keys:
    assert rules[1][0][1] == "(decoder/.*layers.*|mtp_block/.*)"
    assert r"`(decoder/.*layers.*\|mtp_block/.*)`" in markdown
  else:
    mtp = next(r for r in glance[1] if r[0] == "MTP block")
    assert mtp[3] == "no rule matches (quantization=int8 covers decoder/.*layers.* only)"


def test_markdown_cells_escape_every_character_that_would_change_them():
  text = "a | b *c* _d_ `e` [f](g) <h> ~i~ &amp; \\ j"
  header, rows = _tables(f"| x | y |\n|---|---|\n| {coverage_format.md_cell(text)} | "
                         f"{coverage_format.md_code('(p|q)` r')} |\n")[0]
  assert header == ["x", "y"] and rows == [[text, "(p|q)` r"]]


# HTML ----------------------------------------------------------------------------------------------------------

class _Page(html_parser.HTMLParser):
  """The page's title, its tables (rows of cell text, with each row's swatch colour) and its badge colours."""

  def __init__(self, page):
    super().__init__()
    self.title, self.tables, self.badges = "", [], collections.Counter()
    self._in_title = self._cell = False
    self._swatch = ""
    self.feed(page)

  def handle_starttag(self, tag, attrs):
    style = dict(attrs).get("style") or ""
    color = re.search(r"background-color:\s*(#[0-9a-fA-F]{6})", style)
    if tag == "title":
      self._in_title = True
    elif tag == "table":
      self.tables.append([])
    elif tag == "tr":
      self.tables[-1].append(([], ""))
    elif tag in ("td", "th"):
      self._cell = True
      self.tables[-1][-1][0].append("")
    elif tag == "span" and color and "swatch" in (dict(attrs).get("class") or ""):
      self.tables[-1][-1] = (self.tables[-1][-1][0], color.group(1))
    elif color and "border-radius" in style:
      self.badges[color.group(1)] += 1

  def handle_endtag(self, tag):
    self._in_title = self._in_title and tag != "title"
    self._cell = self._cell and tag not in ("td", "th")

  def handle_data(self, data):
    if self._in_title:
      self.title += data
    elif self._cell:
      self.tables[-1][-1][0][-1] += data


def test_html_page_has_the_verdicts_a_legend_distinct_colours_and_the_whole_key_set(capsys):
  code, page, _ = run(capsys, "rules", *TINY, "quantize_mtp=false", "--format", "html")
  parsed = _Page(page)
  assert code == 0 and parsed.title == (
      "Qwix rule coverage: model_name=deepseek3-tiny mtp_num_layers=1 quantization=fp8_full quantize_mtp=false "
      "quantize_router_proj=true quantize_logits_proj=false megablox=true")
  glance, legend = parsed.tables[:2]
  report = _report(*TINY, "quantize_mtp=false")
  assert [cells for cells, _ in glance[1:]] == [
      [v.name, v.count, " / ".join(v.types) if v.quantized else "", "; ".join(v.reasons)] for v in report.glance]
  assert [cells[0] for cells, _ in legend[1:]] == ["rule 0 (float8_e4m3fn)", "unquantized"]
  swatches = [color for _, color in legend[1:]]
  assert len(set(swatches)) == 2 and set(parsed.badges) == set(swatches)
  assert "(decoder/.*layers.*|mtp_block/.*)" not in page and "decoder/.*layers.*" in legend[1][0][1]


def test_html_gives_every_rule_its_own_colour(capsys, tmp_path):
  rules = tmp_path / "rules.yml"
  rules.write_text("- module_path: '.*/gate$'\n  weight_qtype: null\n"
                   "- module_path: 'mtp_block/.*'\n  weight_qtype: int8\n"
                   "- module_path: 'decoder/dense_layers/.*'\n  weight_qtype: float8_e5m2\n"
                   "- module_path: 'decoder/.*layers.*'\n  weight_qtype: float8_e4m3fn\n")
  code, page, _ = run(capsys, "rules", *TINY, "--rules", str(rules), "--format", "html")
  legend = _Page(page).tables[1]
  labels = [cells[0] for cells, _ in legend[1:]]
  assert code == 0 and labels == ["rule 0 (unquantized)", "rule 1 (int8)", "rule 2 (float8_e5m2)",
                                  "rule 3 (float8_e4m3fn)", "unquantized"]
  assert len({color for _, color in legend[1:]}) == 5
