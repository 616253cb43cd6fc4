"""One of three ``jax.distributed`` processes reading the tier's job secret, for
``tests/tier/test_peer_channel.py`` (``test_every_process_of_a_job_reads_the_same_secret_once``,
``mp_harness``).

    peer_secret_worker.py

Reads the secret through the peer exchange, then (process 0) deletes it from the key-value
store and every process reads it again through a new exchange. Emits the sha256 and length of
the first read and whether the second read returned the same bytes (kept for the process's
life).
"""

from __future__ import annotations

import hashlib


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  from orbax_pathways.peer import exchange  # pylint: disable=g-import-not-at-top
  from orbax_pathways.transports import in_process  # pylint: disable=g-import-not-at-top

  ex = in_process.peer_exchange(30.0)
  first = ex.secret()
  multihost_utils.sync_global_devices('read')
  if jax.process_index() == 0:  # gone from the store: every process keeps the one it read
    ex.client.key_value_delete(exchange.SECRET_KEY)
  multihost_utils.sync_global_devices('deleted')
  again = in_process.peer_exchange(30.0).secret()
  mp_worker.emit({'sha': hashlib.sha256(first).hexdigest(), 'n': len(first),
                  'cached': again == first})
  multihost_utils.sync_global_devices('done')


if __name__ == '__main__':
  main()
