"""The export flow: plan, read, quantize and write, validate, report, inside a claimed destination.

`destination.claim` checks DST against the inputs and locks it for the run; everything is written to a temporary
directory beside DST (`atomic.atomic_directory`) that replaces DST in one rename only when complete, report
included (see `inspect_tool.output.atomic` and `inspect_tool.output.destination`: what DST may be, the lock, stale
temporaries). `INSPECT_EXPORT_KILL_AT=<point>` makes the process SIGKILL itself at a named point (`KILL_POINTS`),
for tests.

Bounded memory: every array is read, quantized and written by slices sized by `--max-memory` (`budget`,
`write_orbax`). Validation runs after writing, before DST appears, when the models fit (`validate`); otherwise it
is skipped with a line saying how to run it elsewhere, and the report says which happened.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from inspect_tool import errors
from inspect_tool import progress
from inspect_tool.checkpoint import exports
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import restore
from inspect_tool.configuration import config as config_lib
from inspect_tool.configuration import validation
from inspect_tool.coverage import plan as plan_lib
from inspect_tool.distributed import runtime as distributed
from inspect_tool.hf import layouts as hf_layouts
from inspect_tool.fp8_export import quantize
from inspect_tool.fp8_export import report as report_lib
from inspect_tool.fp8_export import validate as validate_lib
from inspect_tool.fp8_export import write_hf
from inspect_tool.fp8_export import write_v4
from inspect_tool.manifest import build as manifest_lib
from inspect_tool.manifest import digests as digests_lib
from inspect_tool.manifest import stored as stored_lib
from inspect_tool.manifest import tally as tally_lib
from inspect_tool.output import atomic
from inspect_tool.output import destination
from inspect_tool.paramtree import params
from inspect_tool.run import batch as batch_lib
from inspect_tool.run import limits
from inspect_tool.run import weights as weights_lib
from inspect_tool.storage import paths
from inspect_tool.streaming import budget
from inspect_tool.streaming import job_plan
from inspect_tool.streaming import job_runner
from inspect_tool.streaming import object_shards
from inspect_tool.streaming import read
from inspect_tool.streaming import source as source_lib
from inspect_tool.streaming import write_orbax

KILL_POINTS = ("start", "arrays", "written", "validated", "report", "swap", "swapped", "swap-aside",
               "upload", "staged", "publishing", "published")  # the last four: gs:// outputs (object_store)


@dataclasses.dataclass(frozen=True)
class ExportResult:
  dst: str
  report: Any  # report.ExportReport or report.HfExportReport (None on the processes but 0)
  validation: Any  # validate.Validation or None (skipped)

  @property
  def passed(self) -> bool:
    return self.validation is None or self.validation.passed


def export(tokens: Sequence[str], dst: str, *, source: str | weights_lib.Weights | None = None,
           overwrite: bool = False, data=None, tokens_file: str | None = None,
           max_kl: float = validate_lib.DEFAULT_MAX_KL, run_validation: bool = True, mesh=None,
           command: str | None = None, max_memory: int | None = None, batch_options: Sequence[str] = (),
           cfg: config_lib.ModelConfig | None = None) -> ExportResult:
  """Exports the quantization-applied model of `tokens` (key=value) from `source` (None: seeded init) to `dst`.

  Args:
    tokens: MaxText key=value overrides (with a quantization, e.g. quantization=fp8_full).
    dst: output directory; appears only when complete.
    source: Orbax checkpoint of the float model (step dir, items dir or steps dir), or the `weights.Weights` the
      caller resolved it to; None: random init.
    overwrite: replace an existing `dst` (which survives any failure).
    data: `batch.Batch` for validation (default: the fixed 2x16 batch).
    tokens_file: where `data` came from (recorded in the report).
    max_kl: the validation gate (KL of every head from the source under the export's numerics, nats).
    run_validation: False skips validation (recorded as skipped).
    mesh: `jax.sharding.Mesh` for validation (default: all devices on one axis).
    command: the command line (recorded in the report).
    max_memory: the peak resident memory to stay under, in bytes (default `budget.default_max_memory()`).
    batch_options: the --tokens/--targets options `data` came from (repeated in the command that validates
      elsewhere when validation cannot run here).
    cfg: `tokens` as the caller resolved them (None: resolved here); either way once for the whole export.

  Under `jax.distributed` with several processes, every process calls this with the same arguments: process 0
  claims DST, each process writes the slices it owns, process 0 completes the checkpoint, validates and reports.
  """
  tokens = list(tokens)
  cfg = cfg if cfg is not None else config_lib.resolve_config(tokens)
  _check_source(cfg, weights_lib.given(source))
  weights = weights_lib.resolve(cfg, source)
  source = weights.given
  max_memory = job_plan.agree_on_inputs(tokens, source, dst, overwrite, budget.resolve_max_memory(max_memory))
  args = dict(source=weights, overwrite=overwrite, data=data, tokens_file=tokens_file, max_kl=max_kl,
              run_validation=run_validation, mesh=mesh, command=command, max_memory=max_memory,
              batch_options=batch_options)
  if distributed.process_index() != 0:
    return _export(cfg, tokens, dst, **args)
  with destination.claim(dst, sources=[source], overwrite=overwrite) as claimed:
    return _export(cfg, tokens, claimed.path, **args)


@dataclasses.dataclass(frozen=True)
class ExportMemory(job_runner.Memory):
  """The export's `memory` section: the runner's figures, then how its arrays were read (two passes, ahead,
  streamed), the allocator's kept blocks and what reading decoded (`report.decoding`)."""
  two_pass_arrays: int
  read_ahead_arrays: int
  boxes_read_ahead: int
  streamed_arrays: int
  absmax_ahead_arrays: int
  kept_freed_bytes: int
  decoding: dict


def _check_source(cfg, source: str | None) -> None:
  """Refuses up front (one line, exit 2) a model MaxText cannot run, and a random init (no source) that does not
  fit in the available memory (`read.InitSource` builds the whole model)."""
  validation.check_runs(cfg, "export")
  if source is None:
    limits.check_init_memory(cfg, "export --random-init")


def _validation_skip(source_bytes: int, max_memory: int) -> str | None:
  """Why validation cannot run here (None: it can): several processes, or the models do not fit."""
  if distributed.process_count() > 1:
    return (f"validation runs in one process; this export ran in {distributed.process_count()} (every array's "
            "metadata and chunks were checked and one chunk of each read back)")
  need = validate_lib.memory_needed(source_bytes)
  have = max_memory - budget.current_rss()
  if need > have:
    return (f"validation needs about {budget.format_size(need)} (the float model, then the export, one at a time) "
            f"and --max-memory leaves {budget.format_size(max(have, 0))}")
  return None


def _validation_memory(leaves) -> int:
  """The --max-memory under which validation of an export of `leaves` runs: its need beside what is held now."""
  return validate_lib.memory_needed(sum(read.nbytes(leaf) for leaf in leaves)) + budget.current_rss()


def _source_path(weights: weights_lib.Weights):
  """Where an export reads its arrays: the Orbax pytree its command resolved, None for the random init; an export or
  a Hugging Face directory is refused (one line)."""
  if weights.kind in (weights_lib.RANDOM, weights_lib.ORBAX):
    return weights.resolved
  read.check_source(weights.given)  # an export: exported from already
  return locate.resolve_orbax_path(weights.given)  # not an Orbax checkpoint: says so


def _export(cfg, tokens, dst, *, source, overwrite, data, tokens_file, max_kl, run_validation, mesh, command,
            max_memory, batch_options) -> ExportResult:
  """`export` once DST is claimed (checked against the inputs and locked) by process 0; `source` resolved
  (`weights.Weights`)."""
  weights, source = source, source.given
  plan = plan_lib.plan_export(cfg)
  leaves = params.model_leaves(cfg)
  mesh = mesh if mesh is not None else restore.default_mesh()
  max_memory = int(max_memory)
  kept = budget.streaming_allocations(max_memory)
  src = read.open_source(cfg, _source_path(weights), leaves)
  jobs = job_runner.plan(plan, src, max_memory, kept)
  source_bytes = sum(read.nbytes(job.leaf) for job in jobs)
  skipped = None
  rerun = report_lib.run_elsewhere(tokens, dst, batch_options)
  if run_validation:
    skipped = _validation_skip(source_bytes, max_memory)
    if skipped and distributed.process_index() == 0:
      progress.note(f"validation skipped: {skipped}; run it where the model fits: {rerun}")
    if not skipped and data is None:
      data = batch_lib.load_batch(None, None, vocab_size=cfg.vocab_size, max_target_length=cfg.max_target_length)
  else:
    skipped = "--no-validate"
  tally, described = tally_lib.Tally(), manifest_lib.orbax_described(jobs)
  validated = []

  def write(tmp):
    digests = _digests(tmp, lambda name: described.get(name, manifest_lib.Described()).scale_of is not None, True)
    try:
      written = write_orbax.write_checkpoint(jobs, src, tmp, dst,
                                             label=f"exporting {len(jobs)} arrays ({len(plan.weights)} quantized)",
                                             quantizers=quantize.Quantizers, tally=tally, digests=digests)
    except BaseException:
      digests.close(cancel=True)  # its threads stop, its scratch files go
      raise
    return written, digests

  def manifest(tmp, written):
    return _write_manifest(tmp, manifest_lib.orbax_catalogue(jobs), written[1], described, tally, "orbax",
                           max_memory)

  def report(tmp, written, summary):
    written = written[0]
    validation = None
    if not skipped:
      budget.hand_back_freed()  # what the streaming kept: validation plans beside the resident size
      exported = locate.ResolvedPath(written.items_dir, report_lib.STEP,  # read back where it was written
                                     unpublished=paths.is_remote(written.items_dir))
      validation = validate_lib.validate(cfg, weights, exported, data, max_kl=max_kl, mesh=mesh,
                                         tokens=tokens_file or "fixed")
    validated.append(validation)
    atomic.test_point("validated")
    memory = ExportMemory.of(jobs, max_memory, two_pass_arrays=sum(job.two_pass for job in jobs),
                             read_ahead_arrays=sum(job.ahead for job in jobs),
                             boxes_read_ahead=written.boxes_read_ahead,
                             streamed_arrays=sum(job.streamed for job in jobs),
                             absmax_ahead_arrays=sum(bool(job.ahead_box) for job in jobs), kept_freed_bytes=kept,
                             decoding=report_lib.decoding(src.decoded(),
                                                          {job.leaf.key: read.nbytes(job.leaf) for job in jobs}))
    document = report_lib.build_report(plan, tokens=tokens, source=source, command=command, copied=written.copied,
                                       source_bytes=source_bytes, written_bytes=written.written_bytes,
                                       mesh_devices=int(mesh.size), validation=validation,
                                       validation_skipped=skipped, memory=memory, rerun=rerun)
    document.manifest = summary
    return document

  document = job_runner.run(dst, overwrite, exports.REPORT_NAME, write, report, merged=manifest)
  if document is None:
    return ExportResult(paths.absolute(dst), None, None)
  return ExportResult(paths.absolute(dst), document, validated[0])


def _digests(tmp: str, counted, background: bool) -> digests_lib.Digests:
  """The hashes of the tensors the export writes, taken as they are written; scratch files (for arrays written out
  of C order beyond the memory plan's room) in the export's temporary directory, none on gs:// (nothing is written
  to local disk: such an array is read back)."""
  remote = paths.is_remote(tmp)
  return digests_lib.Digests(None if remote else tmp, counted, background, scratch=not remote)


def _write_manifest(tmp: str, catalogue: dict, digests: digests_lib.Digests, described: dict,
                    tally: tally_lib.Tally, layout: str, max_memory: int) -> dict:
  """Every process hands over the hashes its writer took and its tally; an array no writer hashed (one that several
  processes wrote parts of; on gs://, one written out of C order beyond the memory plan's room) is read back and
  hashed (by each process, its share); process 0 writes `tmp/export_manifest.json` and returns its summary for the
  report (others: {})."""
  merged = tally_lib.Tally()
  for text in distributed.gather_text(tally.to_json()):
    merged.merge(text)
  found = {}
  for text in distributed.gather_text(json.dumps(digests.found())):
    found.update(json.loads(text))
  missing = [name for name in catalogue if name not in found]  # the same list on every process
  if missing:
    tensors = stored_lib.StoredTensors(tmp)
    with progress.step(f"hashing {len(missing)} stored tensors read back for {manifest_lib.NAME}", plain=True):
      found.update(manifest_lib.hashes(tensors, described,
                                       manifest_lib.piece_bytes_for(max_memory, budget.current_rss()), missing))
  if distributed.process_index() != 0:
    return {}
  doc = manifest_lib.manifest(catalogue, found, described, merged, layout)
  atomic.write_inside(tmp, manifest_lib.NAME, json.dumps(doc, indent=1) + "\n")
  return manifest_lib.summary(doc)


def export_deepseek_fp8(tokens: Sequence[str], dst: str, *, source: str | weights_lib.Weights | None = None,
                        overwrite: bool = False, cfg: config_lib.ModelConfig | None = None,
                        mesh=None, max_memory: int | None = None, data=None, tokens_file: str | None = None,
                        max_kl: float = validate_lib.DEFAULT_MAX_KL, run_validation: bool = True,
                        command: str | None = None, fp8: bool = True,
                        batch_options: Sequence[str] = (), layout: str | None = None,
                        scale_fmt: str | None = None) -> ExportResult:
  """`--layout deepseek-fp8`: DeepSeek-V3's FP8 release layout (HF safetensors, 128x128 block scales; power-of-two
  scales with `scale_fmt="ue8m0"`, V3.1's); with `fp8=False`, `--layout deepseek-bf16`: the same names and files in
  bfloat16, unquantized (the way back to Hugging Face after `import`); `layout="deepseek-v4"`: DeepSeek-V4's release
  layout (`write_v4`: FP4 routed experts, FP8 with e8m0 scales).

  The conversion is `write_hf.write_deepseek_fp8`; here the source arrays are read by blocks and converted one
  unit of work at a time (one expert, one layer's matrix, a block of rows), sized by `max_memory`
  (`budget.resolve_max_memory`; `write_hf.plan_memory` refuses a budget the largest unit does not fit), and
  the output directory appears only when complete. Its quantization is the release's, not the config's rules.
  `source` and `cfg` as `export` takes them. Validation takes `export`'s arguments: the export is read back through the HF reader (dequantized) and run
  beside the source under the layout's own numerics (`validate.validate_hf`), when the models fit;
  `quantization_report.json` is written in DST either way.
  """
  tokens = list(tokens)
  chosen = hf_layouts.resolve(layout or ("deepseek-fp8" if fp8 else "deepseek-bf16"), scale_fmt)
  cfg = cfg if cfg is not None else config_lib.resolve_config(tokens)
  hf_layouts.check_quantization(chosen, cfg.quantization)
  _check_source(cfg, weights_lib.given(source))
  weights = weights_lib.resolve(cfg, source)
  source = weights.given
  if chosen.v4:
    write_v4.check_supported(cfg)
  max_memory = budget.resolve_max_memory(max_memory)
  kept = budget.streaming_allocations(max_memory)
  with destination.claim(dst, sources=[source], overwrite=overwrite) as claimed:
    leaves = params.model_leaves(cfg)
    arrays = read.open_source(cfg, _source_path(weights), leaves)  # tensorstore views: read when indexed
    keyed = source_lib.Keyed(arrays)  # each array opened once here
    work_bytes = write_hf.plan_memory(arrays.keys(), cfg, max_memory, v4=chosen.v4,
                                      held=budget.current_rss() + kept + budget.reserve_bytes(chosen.fp8)
                                      + write_hf.RESERVE_BYTES
                                      + (object_shards.RESERVE_BYTES if paths.is_remote(claimed.path) else 0),
                                      chunk_shape=keyed.chunk_shape, read_overhead=keyed.read_overhead,
                                      cached_overhead=keyed.cached_overhead if arrays.cached_reads else None,
                                      stream_overhead=keyed.stream_overhead)
    skipped = "--no-validate"
    rerun = report_lib.run_elsewhere_hf(tokens, source, claimed.path, layout=chosen,
                                        max_memory=_validation_memory(leaves), batch_options=batch_options,
                                        max_kl=max_kl)
    if run_validation:
      skipped = _validation_skip(sum(read.nbytes(leaf) for leaf in leaves), max_memory)
      if skipped:
        progress.note(f"validation skipped: {skipped}; run it where the models fit: {rerun}")
      elif data is None:
        data = batch_lib.load_batch(None, None, vocab_size=cfg.vocab_size, max_target_length=cfg.max_target_length)
    tally, validated = tally_lib.Tally(), []

    def write(tmp):
      nonlocal arrays
      digests = _digests(tmp, lambda name: name.endswith(".scale" if chosen.v4 else "_scale_inv"), False)
      what = "DeepSeek-V4" if chosen.v4 else f"DeepSeek {'FP8' if chosen.fp8 else 'bf16'}"
      with progress.step(f"writing {what} safetensors ({len(arrays)} arrays)"):
        try:
          args = dict(work_bytes=work_bytes, chunk_shape=keyed.chunk_shape, read_overhead=keyed.read_overhead,
                      tally=tally, digests=digests)
          if chosen.v4:
            summary = write_v4.write_deepseek_v4(_Views(arrays), cfg, tmp, **args)
          else:
            summary = write_hf.write_deepseek_fp8(_Views(arrays), cfg, tmp, fp8=chosen.fp8,
                                                  scale_fmt=chosen.scale_fmt, **args)
        except errors.InputError as e:  # name the destination, not its temporary directory
          raise errors.InputError(str(e).replace(tmp, claimed.path)) from None
        finally:
          arrays.close_stream()
      decoding = report_lib.decoding(arrays.decoded(),
                                     {key: read.nbytes(arrays.leaf(key)) for key in arrays.keys()})
      arrays = None  # the source views are done with (validation reads the source again)
      keyed.clear()
      return (summary, decoding), digests

    def manifest(tmp, written):
      (summary, _), digests = written
      return _write_manifest(tmp, manifest_lib.safetensors_catalogue(summary.weight_map, digests),
                             digests, manifest_lib.hf_described(summary.origins, v4=chosen.v4), tally,
                             chosen.label, max_memory)

    def report(tmp, written, summary_of_manifest):
      summary, decoding = written[0]
      validation = None
      if not skipped:
        budget.hand_back_freed()
        validation = validate_lib.validate_hf(cfg, weights, tmp, data, layout=chosen, max_kl=max_kl,
                                              mesh=mesh if mesh is not None else restore.default_mesh(),
                                              tokens=tokens_file or "fixed")
      validated.append(validation)
      return report_lib.HfExportReport(report_lib.origin(cfg, source, command), tuple(tokens), cfg, chosen, summary,
                                       claimed.path, max_memory, decoding,
                                       report_lib.Validated(validation, skipped, rerun), summary_of_manifest)

    document = job_runner.run(claimed.path, overwrite, exports.REPORT_NAME, write, report, merged=manifest)
  return ExportResult(claimed.path, document, validated[0])


class _Views:
  """The source's arrays as `write_hf` reads them: key -> lazy array (reads counted, `read.ArrayView`)."""

  def __init__(self, source):
    self._source = source

  def keys(self):
    return self._source.keys()

  def __getitem__(self, key):
    return self._source.view(key)
