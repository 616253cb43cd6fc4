"""The peer channel: how the job's processes reach each other's node-local tiers, authenticated
by the job's secret and bounded in size and time.

Modules, each one job:

- ``wire``: the channel's framing, handshake, MACs and bounds.
- ``server``: a TCP server per process serving its node's tier to the job's processes; the
  request kinds it answers are its op table (``server.OPS``).
- ``client``: other hosts' tiers: the restore's peer source, the client side of the channel
  (deadlines, bytes in flight capped).
- ``exchange``: the job's peer secret and the key-value exchange of who holds what.

What runs over the channel for the fleet (relay, partner copies, the restore's source chain)
is in ``orbax_pathways/fleet/``. No jax here.
"""
