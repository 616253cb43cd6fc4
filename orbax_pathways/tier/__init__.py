"""The node-local tier: each host's copy of the chunks it wrote of a committed step, in node-local
memory (a tmpfs directory, by default under ``/dev/shm``), read first on restore.

Modules, each one job:

- ``manifest``: where an entry lives and what its manifest says (pure: names and msgpack).
- ``fsafe``: every file system access of the tier: ``0700`` directories, ``0600`` files, no
  symlink followed, only regular files of the recorded size read.
- ``store``: writes an entry in the background part of a save, marks it committed after the
  step commits and drops older ones, lists entries (the CLI), resolves ``Options.local_dir``.
- ``gc``: node-level clean-up once per save (and ``orbax-pathways tier --gc``): other
  checkpoint directories' entries idle past ``Options.local_max_age_s`` or incomplete, and the
  oldest entries while the tier is over ``Options.local_max_bytes`` (planning pure, then I/O).
- ``chain``: the per-chunk source chain of a restore (this node's tier -> other hosts' tiers ->
  the relay -> storage; no storage for a local-only step), verified against the committed
  step's checksums from storage.
- ``chunk_read``: a chunk file read straight into its place in the region's buffer.
- ``peer``: other hosts' tiers: the chain's peer source, the client side of the peer channel
  (deadlines, bytes in flight capped).
- ``peer_server``: a TCP server per process serving its node's tier to the job's processes.
- ``exchange``: the job's peer secret and the key-value exchange of who holds what.
- ``wire``: the peer channel's framing, handshake, MACs and bounds.
- ``relay``: a chunk no tier holds that several processes need, read from storage once for
  them all.
- ``partners``: who keeps whose second copy of a local-only step (``Options.local_copies=2``;
  pure: the same rank in the next slice).
- ``partner_copy``: sends this process's entry of a local-only step to its partner (``put``).
- ``receive``: the server's side of ``put``: a partner copy written into this node's tier.

The tier is not part of the checkpoint format (``docs/format.md``): storage stays the truth, a
tier entry is used only when its save id is the one storage's index records for its writer.
No jax here: the CLI lists and verifies tiers.
"""
