"""A tier server of the peer channel in a process of its own, for ``tests/tier/test_peer_channel.py``
(the ``server_process`` fixture, ``procs.started``): the test measures its threads, descriptors
and memory from outside while it attacks it.

    python -m support.workers.peer_server_worker TIER SECRET_HEX

Serves ``TIER`` with the job secret ``SECRET_HEX`` (at most 16 connections, 2 s handshake and
idle deadlines), prints its address, then answers each line on stdin with the server's refusal
counts (``peer_server.server_counts()``) as JSON. The test sets
``ORBAX_PATHWAYS_DISABLE=1``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  from orbax_pathways.peer import server as peer_server, wire  # pylint: disable=g-import-not-at-top

  addr = peer_server.serve(sys.argv[1], bytes.fromhex(sys.argv[2]),
                           wire.Limits(max_connections=16, handshake_s=2.0, idle_s=2.0))
  print(addr, flush=True)
  for _ in sys.stdin:  # 'counts': what the server refused so far
    print(json.dumps(peer_server.server_counts()), flush=True)


if __name__ == '__main__':
  main()
