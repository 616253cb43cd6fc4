"""A data iterator and its Orbax handler, as grain's: the handler writes the iterator's position
when its ``save`` runs, a JSON file per process (``process_<i>-of-<n>.json``), so only the
handler itself can save it (``multitier/node_loop_items.py``). Importing registers the
arguments with the handler, as grain's module does. ``V1Iterator``: the same as an Orbax v1
``StatefulCheckpointable`` (MaxText's ``GrainCheckpointable`` under v1's
``training.Checkpointer``): its ``save`` takes the position, the write comes after."""

from __future__ import annotations

import dataclasses
import json

import jax
import orbax.checkpoint as ocp


class Iterator:
  """A data iterator: its position moves on at every training step."""

  def __init__(self, pos: int = 0):
    self.pos = pos


@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  item: Iterator


@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  item: Iterator


def _name() -> str:
  return f'process_{jax.process_index()}-of-{jax.process_count()}.json'


class IteratorHandler(ocp.CheckpointHandler):
  """The iterator's position at ``save``; ``restore`` sets it back."""

  def save(self, directory, args):
    (directory / _name()).write_text(json.dumps({'pos': args.item.pos}))

  def restore(self, directory, args):
    args.item.pos = json.loads((directory / _name()).read_text())['pos']
    return args.item


ocp.args.register_with_handler(IteratorHandler, for_save=True)(IteratorSave)
ocp.args.register_with_handler(IteratorHandler, for_restore=True)(IteratorRestore)


class V1Iterator(ocp.v1.StatefulCheckpointable):
  """A data iterator as Orbax v1 saves it: ``save`` snapshots the position and returns the
  write, which waits for the directory (v1's two phases); ``load`` sets the position back."""

  def __init__(self, pos: int = 0):
    self.pos = pos

  async def save(self, directory):
    pos = self.pos  # the position at the save; the loop moves on before the write

    async def write():
      path = await directory.await_creation()
      (path / _name()).write_text(json.dumps({'pos': pos}))

    return write()

  async def load(self, directory):

    async def read():
      self.pos = json.loads((directory / _name()).read_text())['pos']

    return read()
