"""``orbax-pathways``: inspect and verify Orbax checkpoints, with or without orbax-pathways metadata.

Reads with numpy + tensorstore only; never imports jax or initializes an accelerator.

Modules:
  inspect  reads a checkpoint directory into dataclasses (steps, states, items, leaves).
  verify   reads every chunk; checks crc32c from ``_pathways`` metadata, or decodes only.
  main     argparse, dispatch and output formatting (``main(argv) -> exit code``).
"""
