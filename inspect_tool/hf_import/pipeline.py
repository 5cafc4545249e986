"""The import flow: a Hugging Face DeepSeek directory → a MaxText Orbax checkpoint, inside a claimed destination.

Stages: keys (`keys`: config.json translated, the user's keys checked against it) → the model's leaves → the
source (`source.HfSource`: every leaf read from the release's tensors) → the export's writer (`fp8_export.
write_orbax`: slices within `--max-memory`, every process its share, `DST/0/items` in MaxText's converter
layout) → the MTP block's copies of the embedding and head checked → `import_report.json`. DST is claimed and
written as `export` writes (`output.destination`, `output.atomic`): it appears complete or not at all.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Sequence

import numpy as np

from inspect_tool import progress
from inspect_tool.hf import config as hf_config
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.distributed import runtime as distributed
from inspect_tool.hf_import import inputs
from inspect_tool.hf_import import keys as keys_lib
from inspect_tool.hf_import import source as source_lib
from inspect_tool.output import destination
from inspect_tool.output import ours
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths
from inspect_tool.streaming import budget
from inspect_tool.streaming import job_plan
from inspect_tool.streaming import job_runner
from inspect_tool.streaming import write_orbax

REPORT_NAME = "import_report.json"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ImportReport:
  """What an import wrote, from what, by which command (`to_dict()`: its `import_report.json`)."""

  producer: dict
  created: str
  command: str | None
  source: str
  keys: tuple  # the MaxText keys that load DST
  cfg: Any  # their `ModelConfig`
  arrays: dict  # MaxText key (dotted) -> {"shape", "dtype", "source": the release tensors it came from}
  num_parameters: int
  bytes_written: int
  mtp_shared_copies: list  # the MTP block's copies of the embedding and head, checked (`mtp_copies`)
  unused_tensors: list
  mtp_not_imported: dict | None
  not_computed_by_maxtext: list
  memory: Any  # `job_runner.Memory`

  def to_dict(self) -> dict:
    return {
        "format": {"version": FORMAT_VERSION, "layout": "orbax", "step": write_orbax.STEP, "item": write_orbax.ITEM},
        "producer": self.producer, "created": self.created, "command": self.command, "source": self.source,
        "maxtext_keys": list(self.keys), "model_name": self.cfg.model_name, "weight_dtype": self.cfg.weight_dtype,
        "scan_layers": self.cfg.scan_layers, "arrays": self.arrays, "num_arrays": len(self.arrays),
        "num_parameters": self.num_parameters, "bytes_written": self.bytes_written,
        "mtp_shared_copies": self.mtp_shared_copies, "unused_tensors": self.unused_tensors,
        "mtp_not_imported": self.mtp_not_imported, "not_computed_by_maxtext": self.not_computed_by_maxtext,
        "memory": self.memory.to_dict(),
    }


@dataclasses.dataclass(frozen=True)
class ImportResult:
  source: str  # as given
  dst: str
  report: ImportReport | None  # None on the processes but 0


@dataclasses.dataclass(frozen=True)
class _NoQuantization:
  """The export plan of an import: every array is copied (converted), none quantized."""

  weights: dict = dataclasses.field(default_factory=dict)


def import_checkpoint(path: str, dst: str, tokens: Sequence[str] = (), *, overwrite: bool = False,
                      max_memory: int | None = None, command: str | None = None,
                      resolved: inputs.Inputs | None = None) -> ImportResult:
  """Imports the HF DeepSeek directory `path` into a MaxText Orbax checkpoint at `dst` (`dst/0/items`).

  `tokens` are MaxText key=value overrides on top of the keys the directory determines (`keys`: `scan_layers`,
  `weight_dtype`, `param_scan_axis` are free; keys contradicting config.json are refused). Under
  `jax.distributed` every process calls this with the same arguments; process 0 claims DST and reports.
  `resolved`: the `inputs.Inputs` of `path`, `tokens` and `max_memory`, when the caller resolved them (the CLI,
  before joining a job); otherwise resolved here, once.
  """
  given = path
  resolved = resolved if resolved is not None else inputs.resolve_inputs(path, tokens, max_memory)
  path, keys, cfg, max_memory = resolved.path, resolved.keys, resolved.cfg, resolved.max_memory
  max_memory = job_plan.agree_on_inputs(keys, path, dst, overwrite, max_memory)
  args = dict(overwrite=overwrite, max_memory=max_memory, command=command)
  if distributed.process_index() != 0:
    report = _import(cfg, keys, path, dst, **args)
  else:
    sources = [] if paths.is_web(path) else [path]  # a URL is no place on this machine to keep DST out of
    with destination.claim(dst, sources=sources, overwrite=overwrite) as claimed:
      report = _import(cfg, keys, path, claimed.path, **args)
  return ImportResult(given, paths.absolute(dst), report)


def _leaves(cfg) -> list[tree.Leaf]:
  return [leaf for leaf in params.model_leaves(cfg) if not (leaf.key[:2] == tree.AUX_PREFIX and "rngs" in leaf.key)]


def _import(cfg, keys, path, dst, *, overwrite, max_memory, command) -> ImportReport | None:
  """`import_checkpoint` once DST is claimed by process 0; the report (None on the other processes)."""
  kept = budget.streaming_allocations(max_memory)
  src = source_lib.HfSource(path, cfg, _leaves(cfg))
  try:
    jobs = job_runner.plan(_NoQuantization(), src, max_memory, kept)
    unused = src.unused_names()
    differences = hf_config.differences(path)
    if distributed.process_index() == 0:
      for text in differences:
        progress.note(f"warning: {path} computes what MaxText does not: {text}")
      if unused:
        shown = ", ".join(unused[:3]) + (f" (+{len(unused) - 3} more)" if len(unused) > 3 else "")
        progress.note(f"warning: {len(unused)} tensor(s) of {path} are not read by the model of these keys: {shown}")

    def write(tmp):
      return write_orbax.write_checkpoint(jobs, src, tmp, dst, label=f"importing {len(jobs)} arrays", step=True)

    def report(tmp, written, merged):  # pylint: disable=unused-argument
      return _report(cfg, keys, src, jobs, written, path=path, command=command, unused=unused,
                     copies=mtp_copies(src, cfg), differences=differences,
                     memory=job_runner.Memory.of(jobs, max_memory))

    document = job_runner.run(dst, overwrite, REPORT_NAME, write, report)
  finally:
    src.close()
  return document


def mtp_copies(src: source_lib.HfSource, cfg) -> list[dict]:
  """The release's per-MTP-layer copies of the embedding and the head, compared with the main ones row band by
  row band (MaxText shares the main ones): [{name, main, equal, max_abs_diff}]."""
  out = []
  for k in range(1, cfg.mtp_num_layers + 1):
    layer = cfg.num_decoder_layers + k - 1
    for copy, main in ((f"model.layers.{layer}.embed_tokens.weight", "model.embed_tokens.weight"),
                       (f"model.layers.{layer}.shared_head.head.weight", "lm_head.weight")):
      if copy not in src.tensors or main not in src.tensors:
        continue
      if src.tensors.shape(copy) != src.tensors.shape(main):
        out.append({"name": copy, "main": main, "equal": False, "max_abs_diff": None})
        continue
      rows, worst = src.tensors.shape(main)[0], 0.0
      band = max(1, source_lib.ROW_BAND_BYTES // (4 * max(1, int(np.prod(src.tensors.shape(main)[1:])))))
      for start in range(0, rows, band):
        stop = min(rows, start + band)
        delta = np.abs(src.tensors.read_rows(copy, start, stop) - src.tensors.read_rows(main, start, stop))
        worst = max(worst, float(np.nanmax(delta)) if delta.size else 0.0)
      out.append({"name": copy, "main": main, "equal": worst == 0.0, "max_abs_diff": worst})
  differing = [c["name"] for c in out if not c["equal"]]
  if differing:
    progress.note(f"warning: {', '.join(differing)} differ from the main embedding/head; MaxText's MTP block "
                  "shares the main ones, which were imported (see import_report.json)")
  return out


def _sources(src: source_lib.HfSource, key: tuple[str, ...]) -> dict:
  """The HF tensors of one leaf, compactly: the first name's pattern, the layers, the expert count, the count."""
  entry = src.entry(key)
  names = src.source_names(key)
  return {"pattern": entry.rule.names[0] if entry.rule.names else None, "layers": list(entry.layers),
          "count": len(names), "first": names[0] if names else None}


def _report(cfg, keys, src, jobs, written, *, path, command, unused, copies, differences,
            memory: job_runner.Memory) -> ImportReport:
  arrays = {".".join(job.out_key): {"shape": list(job.leaf.shape), "dtype": job.leaf.dtype,
                                    "source": _sources(src, job.leaf.key)} for job in jobs}
  return ImportReport(ours.producer(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      command, path, tuple(keys), cfg, arrays,
                      int(sum(int(np.prod(job.leaf.shape)) for job in jobs)), written.written_bytes, copies,
                      unused, _mtp_not_imported(cfg, src), differences, memory)


def _mtp_not_imported(cfg, src: source_lib.HfSource) -> dict | None:
  """DeepSeek-V4's MTP block, left out (the user said mtp_num_layers=0; `keys.refuse_v4_mtp` otherwise)."""
  names = hf_names_v4.mtp_tensors(src.tensors.table) if cfg.decoder_block == "deepseek4" else []
  return {"tensors": names, "count": len(names), "reason": keys_lib.MTP_REASON} if names else None


def format_text(result: ImportResult) -> str:
  """The command's summary, ending with the keys to use with DST."""
  report = result.report
  keys = " ".join(report.keys)
  lines = [f"imported {result.source}: {len(report.arrays)} arrays, {report.num_parameters:,} parameters "
           f"({report.cfg.weight_dtype}, {'scanned' if report.cfg.scan_layers else 'unscanned'}) into {result.dst}",
           f"MaxText keys: {keys}",
           f"use with: inspect_checkpoint forward {keys} --checkpoint {result.dst}"]
  return "\n".join(lines) + "\n"
