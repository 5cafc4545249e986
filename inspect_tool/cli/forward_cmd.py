"""`forward`: run the model (random init or a checkpoint, quantized when configured) on a token batch."""

from __future__ import annotations

import dataclasses

import click

from inspect_tool.cli import options


@click.command(epilog=options.example("forward model_name=deepseek3-tiny mtp_num_layers=1 "
                                      "override_model_config=true base_num_decoder_layers=4 "
                                      "first_num_dense_layers=1 vocab_size=1024 --checkpoint "
                                      "tests/data/ckpt_deepseek3-tiny-L4-V1024"))
@options.overrides_argument
@click.option("--checkpoint", type=options.InputPath("the source"),
              help="MaxText-layout Orbax checkpoint, or Hugging Face DeepSeek "
              "directory (config.json + safetensors, bf16 or FP8), to load (default: seeded random init).")
@click.option("--tokens", "tokens_file", type=options.InputPath("the tokens file"),
              help="int tokens (batch, seq) .npy (default: a fixed 2x16 batch).")
@click.option("--targets", "targets_file", type=options.InputPath("the targets file"),
              help="int targets .npy (default: tokens shifted left).")
@click.option("--save-logits", "--save_logits", "save_logits", type=options.OutputPath(),
              help="Write logits (and mtp_logits) to this .npz.")
@click.option("--compare", is_flag=True, help="Also run unquantized and report cosine, top-1 agreement and KL per head.")
@click.option("--grad", is_flag=True, help="Also compute the training loss gradient (norm, finiteness).")
@click.option("--verbose", is_flag=True, help="Say on stderr which given keys the pass uses and which it ignores.")
@options.report_options()
@options.distributed_options
@options.compile_cache_option
def forward(overrides, checkpoint, tokens_file, targets_file, save_logits, compare, grad, verbose, fmt, output_file,
            coordinator, num_processes, process_id, timeout, quiet):
  """Run the model of key=value overrides; print the weights it ran, the loss, MTP loss per depth and top-1
  predictions.

  With quantization=fp8_full the pass runs under Qwix quantized training (QT) with the config's rules.
  """
  from inspect_tool.run import batch  # pylint: disable=import-outside-toplevel
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from quant import metrics  # pylint: disable=import-outside-toplevel
  from inspect_tool.run import runner as running  # pylint: disable=import-outside-toplevel
  from inspect_tool.report import forward_format  # pylint: disable=import-outside-toplevel

  options.check_output_files(save_logits, output_file)
  cfg = config.resolve_config(overrides)  # every input checked before joining: a bad one ends no other process
  data = batch.load_batch(tokens_file, targets_file, vocab_size=cfg.vocab_size,
                          max_target_length=cfg.max_target_length)
  from inspect_tool.run import weights  # pylint: disable=import-outside-toplevel
  used = weights.resolve(cfg, checkpoint)  # the checkpoint found (or named in one line) before joining, once
  options.start_processes(coordinator, num_processes, process_id, quiet, timeout)
  if verbose:
    click.echo("\n".join(config.describe_keys(overrides)), err=True)
  if compare and weights.is_random(checkpoint):
    click.echo(weights.RANDOM_WARNING.format(seed=cfg.init_weights_seed), err=True)
  outcome = running.run(cfg, data, checkpoint=used, compare=compare, grad=grad)
  from inspect_tool.distributed import runtime as distributed  # pylint: disable=import-outside-toplevel
  if distributed.process_count() > 1:  # results sharded over every process's devices: gather, process 0 reports
    outcome = dataclasses.replace(outcome, result=distributed.to_host(outcome.result),
                                  reference=distributed.to_host(outcome.reference))
    if distributed.process_index() != 0:
      return 0
  comparisons = metrics.compare_heads(outcome.reference, outcome.result) if outcome.reference is not None else ()
  if save_logits:
    options.check_output_files(save_logits)  # again: it may have appeared while the model ran
    forward_format.save_logits(save_logits, outcome.result, overwrite=options.overwrite_requested())
  formatter = forward_format.format_json if fmt == "json" else forward_format.format_text
  options.emit_text(formatter(outcome.result, source=config.model_source(overrides), quantization=cfg.quantization,
                              comparisons=comparisons, grad=outcome.grad, weights=used.label,
                              compared=outcome.compared), output_file)
  return 0
