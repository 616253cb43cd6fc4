"""The peer server's op table: every request kind a server of the package answers beyond
``list`` and ``get`` of its own tier, and the module that answers it. Every caller that starts
the server passes it (``fleet/chain.py`` at a restore, ``fleet/partner_copy.ready``).

- ``relay``: a chunk no tier holds, read from storage once for the processes that need it
  (``fleet/relay.answer``).
- ``put``: one file of a partner copy, written into this node's tier (``fleet/receive.receive``;
  refused unless the server was started with a tier that takes copies).
- ``node_put``, ``node_commit``, ``node_list``, ``node_get``: partner copies of node steps, taken
  into this node and served back (``fleet/node_receive.py``).
"""

from __future__ import annotations

from orbax_pathways.fleet import node_receive
from orbax_pathways.fleet import receive
from orbax_pathways.fleet import relay
from orbax_pathways.peer import server

TABLE = server.Ops(
    answer={'relay': relay.answer},
    receive={'put': receive.receive, 'node_put': node_receive.put_file,
             'node_commit': node_receive.commit},
    serve={'node_list': node_receive.listing, 'node_get': node_receive.get})
