"""The HTML page in real headless Chromium: treescope draws the tree inside a shadow root, visibly.

Needs Debian's `chromium` and `chromium-driver` (`scripts/install_chromium.sh` installs them).
"""

import re

import pytest
from selenium import webdriver
from selenium.webdriver.chrome import options as chrome_options
from selenium.webdriver.chrome import service as chrome_service
from selenium.webdriver.support import wait

from inspect_tool.configuration import config
from inspect_tool import model as model_lib
from inspect_tool.paramtree import tree
from inspect_tool.report import html

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Flags for a closed network: without them Chromium waits on background requests.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1200,900")

# innerText of every shadow root's children (recursively): what a reader sees, folded parts excluded.
VISIBLE_TEXT_JS = """
const texts = [];
function walk(root) {
  for (const element of root.querySelectorAll('*')) {
    if (element.shadowRoot) {
      for (const child of element.shadowRoot.children) {
        if (child.innerText) texts.push(child.innerText);
      }
      walk(element.shadowRoot);
    }
  }
}
walk(document);
return texts.join('\\n');
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
  options = chrome_options.Options()
  options.binary_location = CHROMIUM
  for flag in FLAGS:
    options.add_argument(flag)
  options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(options=options, service=chrome_service.Service(executable_path=CHROMEDRIVER))
  driver.set_page_load_timeout(20)
  yield driver
  driver.quit()


def _leaves():
  """A DeepSeek-V3-like checkpoint listing: scanned decoder stacks and one MTP layer."""
  mtp = ("mtp_block", "mtp_layer_1", "mtp_1_transformer_layer")
  return [
      tree.Leaf(tree.param_key(("token_embedder", "embedding")), (1024, 64), "float32"),
      tree.Leaf(tree.param_key(("decoder", "decoder_norm", "scale")), (64,), "float32"),
      tree.Leaf(tree.param_key(("decoder", "dense_layers", "mlp", "wi_0", "kernel")), (64, 1, 64), "float32"),
      tree.Leaf(tree.param_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "wi_0")),
                (16, 3, 64, 64), "float32"),
      tree.Leaf(tree.param_key(mtp + ("DeepSeekMoeBlock_0", "MoeBlock_0", "wo")), (16, 64, 64), "bfloat16"),
      tree.Leaf(tree.aux_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias")),
                (3, 16), "float32"),
  ]


DRAW_TIMEOUT_S = 60


def _visible_text(driver, path) -> str:
  driver.get(path.as_uri())
  # Treescope's script builds the shadow root after load; wait until the tree is drawn. The wait is long because a
  # loaded machine (the suite's two workers busy) once took more than 15 s to draw it; the page is the same either way.
  wait.WebDriverWait(driver, DRAW_TIMEOUT_S).until(lambda d: "MoeBlock_0" in d.execute_script(VISIBLE_TEXT_JS))
  return driver.execute_script(VISIBLE_TEXT_JS)


def _severe_console_messages(driver) -> list[str]:
  return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_checkpoint_tree_is_visible_in_chromium(browser, tmp_path):
  page = tmp_path / "ckpt.html"
  page.write_text(html.render_leaves_html(_leaves(), title="tiny checkpoint"), encoding="utf-8")
  text = _visible_text(browser, page)
  for name in ("decoder", "moe_layers", "mtp_block", "mtp_1_transformer_layer", "DeepSeekMoeBlock_0"):
    assert re.search(rf"\b{name}: ", text), name
  assert "wi_0: f32[16,3,64,64]" in text
  assert "wo: bf16[16,64,64]" in text
  assert re.search(r"# [\d.]+K params", text)
  assert browser.title == "tiny checkpoint"
  assert not _severe_console_messages(browser)


def test_deepseek_model_tree_with_labels_is_visible_in_chromium(browser, tmp_path):
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1"])
  page = tmp_path / "model.html"
  page.write_text(html.render_model_html(model_lib.build_model(cfg, abstract=True), title="tiny model", annotations={
      "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0": "rule 0 (fp8 e4m3)",
      "decoder/logits_dense": "unquantized"}), encoding="utf-8")
  text = _visible_text(browser, page)
  for name in ("decoder", "moe_layers", "dense_layers", "mtp_block", "mtp_layer_1", "shared_experts"):
    assert re.search(rf"\b{name}=\w+\(", text), name
  assert re.search(r"MoeBlock_0=\w+\( # 11.5M params · rule 0 \(fp8 e4m3\)", text)
  assert re.search(r"logits_dense=\w+\(kernel=f32\[64,129280\]\) # 8.27M params · unquantized", text)
  assert "wi_0=f32[16,58,64,64]" in text
  assert "bias=MoEBiasVar f32[58,16]" in text
  assert not _severe_console_messages(browser)
