"""``orbax-pathways``: inspect and verify Orbax checkpoints, with or without orbax-pathways metadata.

Reads with numpy + tensorstore only; never imports jax or initializes an accelerator. Names, keys,
grids and spec rules come from ``orbax_pathways.format.names``, the same module the library uses.

Modules (each imports only those above it):
  paths    CLI arguments to epath paths; storage failures to one-line user errors; sizes.
  model    dataclasses: Step, Item, Leaf, Sharding.
  arrays   tensorstore: open saved arrays with Orbax's spec rules, chunk locations, values.
  steps    reads step directories into the model (states, items, leaves, shardings).
  verify   reads every chunk; checks crc32c from ``_pathways`` metadata, or decodes only.
  diff     compares two steps: structure, and values by recorded crc32c or by reading.
  du       bytes per step and per top-level key.
  tier     a node's local tier: its steps, checked against the committed records.
  render   text and JSON output, progress bar.
  main     argparse and dispatch (``main(argv) -> exit code``).
"""
