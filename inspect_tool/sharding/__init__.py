"""Per-parameter sharding and per-device memory on an abstract MaxText mesh (no devices needed).

`placement.plan(leaves, cfg, devices)` gives each leaf MaxText 0.2.5's `PartitionSpec` and shard shape;
`memory.device_memory(...)` sums the bytes one device holds. Modules: `mesh` (axis sizes from the ici_*/dcn_*
keys), `logical_axes` (MaxText's names per variable), `rules` (names → mesh axes), `memory`.
"""
