"""Every command × every DeepSeek-family preset (scanned and unscanned, MTP 0 and 1): each works (exit 0; `diff`
against another model's checkpoint: exit 1 with its findings) or refuses in ONE line with exit 2, never a
traceback.

Commands run in-process (`cli.main`). The abstract commands (listing, `--summary`, `--devices 8`, `rules`,
`diff`) run on every preset; the listing and `diff` as is, while `rules` and `--summary` (whose FP8 size comes from
the same trace) on an unscanned preset trace one dense (or hash-routed) layer and two others
(`base_num_decoder_layers` lowered: the same modules, traced once per layer), except the summary of
`WHOLE_SUMMARY`, which traces all of them. `forward` and `export` run
the presets whose weights do not fit a machine with 16 GiB free (the available-memory figure is set to that, so
the outcome does not depend on the machine): they are refused by the memory check; the tiny presets run as
small variants of their family (`TINY_RUNS`).
"""

import os

import pytest

from inspect_tool import cli
from inspect_tool.configuration import presets
from inspect_tool.host import memory as host_memory

from conftest import DATA
L4_CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
V32_CKPT = os.path.join(DATA, "ckpt_v32-small")
PRESETS = presets.names()
VARIANTS = [(scan, mtp) for scan in (True, False) for mtp in (0, 1)]
CASES = [(p, scan, mtp) for p in PRESETS for scan, mtp in VARIANTS]
IDS = [f"{p}-{'scan' if scan else 'noscan'}-mtp{mtp}" for p, scan, mtp in CASES]
TINY_PRESETS = ("deepseek3-tiny", "deepseek4-tiny", "deepseek-custom")  # fit in 16 GiB: run as small variants
V4_MTP = "DeepSeek4 decoder block currently does not support MTP layers"
L4 = ["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]
V32_SMALL = ["model_name=deepseek3.2-671b", "override_model_config=true", "mtp_num_layers=1", "base_emb_dim=64",
             "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128", "base_moe_mlp_dim=32",
             "base_num_decoder_layers=3", "first_num_dense_layers=1", "vocab_size=512", "num_experts=8",
             "num_experts_per_tok=2", "q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=32",
             "qk_rope_head_dim=16", "v_head_dim=32", "indexer_n_heads=4", "indexer_head_dim=32", "indexer_topk=8"]
CUSTOM = ["model_name=deepseek-custom", "override_model_config=true", "engram_layers=[]"]
CUSTOM_SMALL = CUSTOM + ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
                         "base_moe_mlp_dim=16", "base_num_decoder_layers=2", "vocab_size=64", "num_experts=4",
                         "num_experts_per_tok=2", "q_lora_rank=16", "kv_lora_rank=8", "qk_nope_head_dim=8",
                         "qk_rope_head_dim=8", "v_head_dim=8", "indexer_n_heads=2", "indexer_head_dim=16",
                         "indexer_topk=4", "max_target_length=16"]
V4_SMALL = ["model_name=deepseek4-tiny", "override_model_config=true", "vocab_size=512", "base_num_decoder_layers=5"]


def keys(preset, scan, mtp):
  out = [f"model_name={preset}", f"scan_layers={str(scan).lower()}", f"mtp_num_layers={mtp}"]
  return out + (CUSTOM[1:] if preset == "deepseek-custom" else [])


def refused(preset, mtp) -> str | None:
  """The one-line refusal every command gives (MaxText's own: V4 builds no MTP layer), or None."""
  return V4_MTP if preset.startswith("deepseek4") and mtp else None


def run(capsys, *argv):
  """(exit code, stdout, stderr); an exit 2 must be one line on stderr and nothing on stdout."""
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  assert "Traceback" not in err, err[-3000:]
  if code == 2:
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err[-3000:]
  return code, out, err


def expect(capsys, reason, *argv, ok=(0,)):
  code, out, err = run(capsys, *argv)
  if reason is not None:
    assert code == 2 and reason in err, err
  else:
    assert code in ok and out, err[-3000:]
  return code, out, err


@pytest.fixture
def sixteen_gib_free(monkeypatch):
  """The memory checks see 16 GiB available (MemAvailable), no cgroup limit: the same outcome on every machine."""
  monkeypatch.setattr(host_memory, "memory_figures", lambda: (16 * 2**30, None, None))
  monkeypatch.delenv(host_memory.SKIP_ENV, raising=False)


WHOLE_SUMMARY = ("deepseek3-671b", False, 1)  # the one unscanned --summary that traces every layer (61 and MTP)


@pytest.mark.parametrize("preset, scan, mtp", CASES, ids=IDS)
def test_abstract_commands(preset, scan, mtp, capsys):
  """Listing; --summary with --devices 8 (fsdp 8) and adamw's memory; rules; diff against the L4 checkpoint."""
  given, reason = keys(preset, scan, mtp), refused(preset, mtp)
  _, out, _ = expect(capsys, reason, "maxtext", *given)
  assert reason or "Total Parameters:" in out
  fewer = given if scan else given + _fewer_layers(preset)
  summarized = given if (preset, scan, mtp) == WHOLE_SUMMARY else fewer
  _, out, _ = expect(capsys, reason, "maxtext", *summarized, "--devices", "8", "--summary", "--train", "adamw")
  assert reason or ("Active parameters per token" in out and "Per-device memory on 8 devices (fsdp=8)" in out
                    and "spec: P(" in out)
  traced = fewer + _quantization(preset)
  _, out, err = expect(capsys, reason, "rules", *traced)
  assert reason or "Qwix rule coverage" in out
  assert reason or ("mtp_block is not traced" in err) == (preset == "deepseek-custom" and mtp == 1)
  code, out, _ = expect(capsys, reason, "diff", *given, "--path", L4_CKPT, ok=(0, 1))
  assert reason or code == 1  # another model than the checkpoint's: findings, exit 1


def _quantization(preset):
  """fp8_full, except on batch-split presets (MaxText quantizes them through its own path: refused, see
  tests/test_presets.py): their trace without quantization."""
  return [] if preset.endswith("batchsplit") else ["quantization=fp8_full"]


def _fewer_layers(preset):
  first = {"deepseek4-tiny": 3, "deepseek4-284b": 3}.get(preset)  # hash-routed layers
  if first is None:
    first = 1  # one dense layer
    return ["override_model_config=true", "first_num_dense_layers=1", f"base_num_decoder_layers={first + 2}"]
  return ["override_model_config=true", f"base_num_decoder_layers={first + 2}"]


@pytest.mark.parametrize("given, path", [([*L4, "mtp_num_layers=1"], L4_CKPT), (V32_SMALL, V32_CKPT)],
                         ids=["l4", "v32-small"])
def test_diff_agrees_with_the_matching_maxtext_checkpoint(given, path, capsys):
  code, out, _ = run(capsys, "diff", *given, "--path", path)
  assert code == 0 and "agree" in out


BIG = [c for c in CASES if c[0] not in TINY_PRESETS]


@pytest.mark.parametrize("preset, scan, mtp", BIG, ids=[i for c, i in zip(CASES, IDS) if c in BIG])
def test_forward_and_export_of_big_presets_are_refused_by_the_memory_check(preset, scan, mtp, capsys, tmp_path,
                                                                          sixteen_gib_free):
  del sixteen_gib_free
  given, reason = keys(preset, scan, mtp), refused(preset, mtp)
  expect(capsys, reason or "needs about", "forward", *given)
  dst = tmp_path / "out"
  batchsplit = "with use_batch_split_schedule=true" if preset.endswith("batchsplit") else None
  expect(capsys, reason or batchsplit or "needs about", "export", *given, "quantization=fp8_full", "--no-validate",
         "--random-init", "--output", str(dst))
  assert not dst.exists()


TINY_RUNS = [  # (command line, the refusal expected or None)
    (["forward", *L4, "mtp_num_layers=1"], None),
    (["forward", *CUSTOM_SMALL], None),
    (["export", *L4, "mtp_num_layers=1", "quantization=fp8_full", "--no-validate"], None),
    (["export", *L4, "scan_layers=false", "quantization=fp8_full", "--no-validate"], None),
    (["export", *V4_SMALL, "quantization=fp8_full", "--no-validate"], None),
    (["forward", *V4_SMALL, "mtp_num_layers=1"], V4_MTP),
    (["forward", *CUSTOM_SMALL, "mtp_num_layers=1"], "MaxText 0.2.5 builds this model but its forward pass fails"),
    (["export", *CUSTOM, "mtp_num_layers=1", "quantization=fp8_full", "--no-validate"],
     "MaxText 0.2.5 builds this model but its forward pass fails"),
    (["export", *CUSTOM_SMALL, "quantization=fp8_full", "--no-validate"], None),
]


@pytest.mark.parametrize("argv, reason", TINY_RUNS, ids=[f"{a[0]}-{i}" for i, (a, _) in enumerate(TINY_RUNS)])
def test_forward_and_export_of_small_family_variants(argv, reason, capsys, tmp_path, sixteen_gib_free):
  del sixteen_gib_free
  extra = ["--random-init", "--output", str(tmp_path / "out")] if argv[0] == "export" else []
  expect(capsys, reason, *argv, *extra)
  assert (tmp_path / "out").exists() == (argv[0] == "export" and reason is None)
