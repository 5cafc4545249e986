"""XLA's own verdict: compile a config's training step or forward pass for a TPU topology from any host (libtpu).

Modules: `libtpu` (installed at JAX's pin? its start-up environment), `topology` (MaxText's TPU slice names → the
devices to compile for), `state` (abstract parameters, optimizer state and batch with MaxText's shardings), `step`
(the training step and the forward pass), `build` (trace, lower, compile; XLA's memory), `memory` (the record,
its peak and verdict), `report` (text and JSON beside the analytic plan).
"""
