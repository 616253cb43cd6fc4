"""One ``jax.distributed`` process of ``tests/tier/test_tier_peer.py`` (``mp_harness``): a simulated
node with its own tier directory (``ORBAX_PATHWAYS_TIER_DIR``, set by the test), and the fault
its peer server plays in a survivor-first restore.

    tier_peer_worker.py save|restore CKPT FAULT

``FAULT`` (this process's server): ``none``; ``stall`` (accepts connections, never answers);
``refuse`` (its server is gone when it publishes); ``no_relay`` (answers every relay request with
an error); ``die_mid_chunk`` (closes the connection half-way through a chunk); ``tib`` (claims
a 1 TiB answer, sends nothing); ``dtype`` (its list says int32 for the float32 'w');
``after:P`` (it publishes, and so looks anything up, only once process P has published: the
order of the two, which a restore otherwise leaves to chance); ``tell_empty`` (when it finds a
writer without holder keys, it says so in the key ``<round>.empty``) and ``after_empty`` (it
publishes only once that key is there: so a reader looks before the holder publishes).
``save``: saves steps 1 and 2 of 'w' (sharded), 'b' (row-sharded), 'r' (replicated) and, with
``ORBAX_PATHWAYS_TIER_SCOPE=held`` or ``WITH_M``, 'm' (replicated across slices); emits
``{'saved': True}``. ``restore``: restores step 2 onto the same shardings of the current
processes, checks every addressable shard, emits the step, the bytes by source and the seconds
spent on peers. Both end in a barrier.
"""

from __future__ import annotations

import os
import sys
import time


def _play(fault: str) -> None:
  """Patches this process's peer server (or exchange) to play ``fault``."""
  from orbax_pathways.peer import exchange  # pylint: disable=g-import-not-at-top
  from orbax_pathways.peer import server as peer_server  # pylint: disable=g-import-not-at-top
  from orbax_pathways.peer import wire  # pylint: disable=g-import-not-at-top

  if fault == 'stall':  # accepts connections, never answers
    peer_server._Handler.answer = lambda self, sock, req: time.sleep(3600)
  elif fault == 'refuse':  # its server is gone before it publishes: connections are refused
    publish = exchange.Exchange.publish

    def stop_then_publish(self, *a, **k):
      peer_server.stop_serving()
      return publish(self, *a, **k)

    exchange.Exchange.publish = stop_then_publish
  elif fault == 'no_relay':  # answers every relay request with an error
    from orbax_pathways.fleet import relay  # pylint: disable=g-import-not-at-top

    def refuse(req):
      raise relay.RelayError('simulated: this process cannot read storage for its group')

    from orbax_pathways.fleet import ops as fleet_ops  # pylint: disable=g-import-not-at-top
    fleet_ops.TABLE = peer_server.Ops(answer={'relay': refuse}, receive=fleet_ops.TABLE.receive)
  elif fault == 'die_mid_chunk':  # lists, then closes the connection half-way through a chunk
    answer = peer_server._Handler.answer

    def half(self, sock, req):
      if req.get('op') != 'get':
        return answer(self, sock, req)
      path = os.path.join(self.server.tier_dir, *req['item'], req['entry'], req['file'])
      data = open(path, 'rb').read()
      sock.sendall(wire.ANSWER.pack(0, len(data)) + data[:len(data) // 2])
      raise OSError('simulated death mid-chunk')

    peer_server._Handler.answer = half
  elif fault == 'tib':  # claims a 1 TiB answer to every request (the list first), sends nothing
    def tib(self, sock, req):
      sock.sendall(wire.ANSWER.pack(0, 1 << 40))
      time.sleep(3600)

    peer_server._Handler.answer = tib
  elif fault == 'dtype':  # its list says int32 for the float32 'w' (the bytes are unchanged)
    import msgpack  # pylint: disable=g-import-not-at-top
    listing = peer_server._Server.listing

    def lying(self, parts):
      out = msgpack.unpackb(listing(self, parts), raw=False)
      for e in out.values():
        if 'w' in e['arrays']:
          e['arrays']['w']['dtype'] = 'int32'
      return msgpack.packb(out, use_bin_type=True)

    peer_server._Server.listing = lying
  elif fault.startswith('after:'):  # publishes (then looks up) once process P has published
    other, publish = int(fault.split(':')[1]), exchange.Exchange.publish

    def after(self, prefix, *a, **k):
      self.client.blocking_key_value_get(f'{prefix}/{other}', 120_000)
      return publish(self, prefix, *a, **k)

    exchange.Exchange.publish = after
  elif fault == 'tell_empty':  # says when it found a writer without holder keys
    holders = exchange.Exchange.holders

    def telling(self, prefix, writer):
      found = holders(self, prefix, writer)
      if not found:
        self.client.key_value_set(f'{prefix}.empty', writer, allow_overwrite=True)
      return found

    exchange.Exchange.holders = telling
  elif fault == 'after_empty':  # publishes once a reader found a writer without holder keys
    publish = exchange.Exchange.publish

    def after_empty(self, prefix, *a, **k):
      self.client.blocking_key_value_get(f'{prefix}.empty', 120_000)
      return publish(self, prefix, *a, **k)

    exchange.Exchange.publish = after_empty


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import stats  # pylint: disable=g-import-not-at-top

  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mode, root, fault = sys.argv[1], sys.argv[2], sys.argv[3]
  host = {'w': np.arange(96 * 64, dtype=np.float32).reshape(96, 64) * 0.5,
          'b': np.arange(96, dtype=np.int32), 'r': np.arange(40, dtype=np.float32) + 0.25}
  n = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(n // 2, 2), ('x', 'y'))
  shard = {'w': jax.sharding.NamedSharding(mesh, P('x', 'y')),
           'b': jax.sharding.NamedSharding(mesh, P('x')),
           'r': jax.sharding.NamedSharding(mesh, P())}
  if os.environ.get('ORBAX_PATHWAYS_TIER_SCOPE') == 'held' or os.environ.get('WITH_M'):
    # replicated across slices
    # Large enough (with WITH_M) that its writing is split over the 3 slices (pieces >= 1 MiB).
    rows, cols = (768, 2048) if os.environ.get('WITH_M') else (96, 64)
    host['m'] = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) - 3.0
    shard['m'] = jax.sharding.NamedSharding(mesh, P(None, 'y'))
  _play(fault)

  def make(k):
    return jax.make_array_from_callback(host[k].shape, shard[k], lambda i: host[k][i])

  with ocp.CheckpointManager(root) as m:
    if mode == 'save':
      state = {k: make(k) for k in host}
      for step in (1, 2):
        m.save(step, args=ocp.args.StandardSave(state))
      m.wait_until_finished()
      mp_worker.emit({'saved': True})
    else:
      target = {k: jax.ShapeDtypeStruct(host[k].shape, host[k].dtype, sharding=shard[k])
                for k in host}
      out = m.restore(2, args=ocp.args.StandardRestore(target))
      for k in host:
        for s in out[k].addressable_shards:
          np.testing.assert_array_equal(np.asarray(s.data), host[k][s.index])
      st = stats.last_restore()
      from orbax_pathways.peer import exchange  # pylint: disable=g-import-not-at-top
      mp_worker.emit({'step': st.step, 'bytes_by_source': st.bytes_by_source, 'exact': True,
                      'peer_s': st.seconds_by_source.get('peer', 0.0),
                      'lookups': exchange.lookup_counts()})
    multihost_utils.sync_global_devices('done')


if __name__ == '__main__':
  main()
