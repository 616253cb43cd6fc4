"""The node-local tier: each host's copy of the chunks it wrote of a committed step, in node-local
memory (a tmpfs directory, by default under ``/dev/shm``), read first on restore.

Modules, each one job:

- ``manifest``: where an entry lives and what its manifest says (pure: names and msgpack).
- ``fsafe``: every file system access of the tier: ``0700`` directories, ``0600`` files, no
  symlink followed, only regular files of the recorded size read.
- ``store``: writes an entry in the background part of a save, marks it committed after the
  step commits and drops older ones, lists entries (the CLI), resolves ``Options.tier_dir``.
- ``gc``: node-level clean-up once per save (and ``orbax-pathways tier --gc``): other
  checkpoint directories' entries idle past ``Options.tier_max_age_s`` or incomplete, and the
  oldest entries while the tier is over ``Options.tier_max_bytes`` (planning pure, then I/O).
- ``chunk_read``: a chunk file read straight into its place in the region's buffer.
- ``spares``: retired chunk files kept for the next save's copy to take over.
- ``assigned``: the tier directory an emergency manager assigns to its checkpoint directory.

How the job's processes reach each other's tiers is ``orbax_pathways/peer/``; what they do for
each other with it (the restore's source chain, the relay, partner copies) is
``orbax_pathways/fleet/``.

The tier is not part of the checkpoint format (``docs/format.md``): storage stays the truth, a
tier entry is used only when its save id is the one storage's index records for its writer.
No jax here: the CLI lists and verifies tiers.
"""
