"""What the job's nodes do for each other over the peer channel (``orbax_pathways/peer/``),
around their node-local tiers (``orbax_pathways/tier/``).

Modules, each one job:

- ``chain``: the per-chunk source chain of a restore (this node's tier -> other hosts' tiers ->
  the relay -> storage; no storage for a local-only step), verified against the committed
  step's checksums from storage.
- ``relay``: a chunk no tier holds that several processes need, read from storage once for
  them all (the server's ``relay`` request).
- ``partners``: who keeps whose second copy of a local-only step (``Options.local_copies=2``;
  pure: the same rank in the next slice).
- ``partner_copy``: sends this process's entry of a local-only step to its partner (``put``).
- ``receive``: the server's side of ``put``: a partner copy written into this node's tier.

No jax here.
"""
