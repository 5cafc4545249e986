"""The parameter tree: `Leaf` records, model variables as leaves, summaries and listings."""
