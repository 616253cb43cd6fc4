"""``Options``: the settings of one ArrayHandler (``install(options)``), validated when built;
``Options.from_env`` reads them from the ``ORBAX_PATHWAYS_*`` variables
(``options/variables.py``). A former option name (``choices.FORMER_FIELDS``) still works as a
keyword and an attribute, with one ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping

from orbax_pathways.options.choices import (COMPRESSIONS, DIVISIBILITIES, FORMER_FIELDS,
                                            LOCAL_STEPS_IN, LOCAL_WHEN_BUSY, SNAPSHOTS,
                                            TIER_SCOPES, TRANSPORTS)
from orbax_pathways.options.variables import FIELD_ENV, env_value, field_default, former_transport


def _check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'Options.{name}={value!r}: must be an integer >= {minimum}'
                     f'{" or None" if optional else ""}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """How the handler plans and moves bytes.

  Bytes: how arrays are cut, copied to the host, compressed and checked.
  max_chunk_bytes: upper bound on one stored chunk (``ORBAX_PATHWAYS_MAX_CHUNK_BYTES``, 16 MiB).
    Chunks are cut roughly square inside each shard, so a restore onto another layout decodes
    little beyond what it needs. Stock Orbax stores a whole shard as one chunk.
  max_inflight_bytes: host bytes handed to tensorstore at once while writing
    (``ORBAX_PATHWAYS_MAX_INFLIGHT_BYTES``, 1 GiB): the write-side memory budget on top of the
    device-to-host snapshot.
  coalesce_bytes: an array of at most this many bytes (``ORBAX_PATHWAYS_COALESCE_BYTES``, 1 MiB;
    0 turns it off) is stored as few chunks as the hosts holding it allow (one when a single host
    holds it all) instead of one chunk per shard: biases, norms and counters sharded over many
    devices otherwise cost a chunk write and read each per device. Stock Orbax reads any grid.
  snapshot: how ``save()`` copies device bytes to the host (``ORBAX_PATHWAYS_SNAPSHOT``):
    'pinned' into pinned host memory (``memory_kind='pinned_host'``, one batched transfer at DMA
    speed; the numpy copy for tensorstore then happens in the background write), 'host' through
    ``np.asarray`` (what stock Orbax does; zero-copy on the CPU backend), or 'auto' (default):
    'pinned' on accelerators whose devices offer a pinned_host memory, 'host' on CPU.
  compression: 'auto' (default; ``ORBAX_PATHWAYS_COMPRESSION``): zstd for integer and bool arrays,
    none for floating-point arrays, whose mantissas barely compress (a few percent) while zstd
    costs about a third of the commit and much of the restore; 'zstd' (what stock Orbax writes,
    also when the checkpoint handler asks for no compression we follow it); 'none'. The choice
    depends only on the dtype, so every host of a multi-host save makes the same one. Either way
    the zarr metadata names the codec, so stock Orbax reads the result.
  verify_checksums: check each read chunk against the crc32c recorded at save
    (``ORBAX_PATHWAYS_VERIFY``, on).
  replica_parallel: split a shard held on several hosts among them (on).

  Topology: who moves the bytes, and restores onto another mesh.
  transport: 'in_process' (formerly 'local'), 'colocated' or 'persistence'; None detects (``ORBAX_PATHWAYS_TRANSPORT``).
  num_slices: split devices into this many equal slices when devices carry no ``slice_index``
    (``ORBAX_PATHWAYS_NUM_SLICES``; tests and platforms that know their grouping).
  divisibility: when elastic restore cannot divide a dimension over the resized mesh axes,
    'replicate' that array along them with a warning, or 'strict' to raise
    (``ORBAX_PATHWAYS_DIVISIBILITY``).

  Storage requests.
  gcs_grpc: use tensorstore's ``gcs_grpc`` driver instead of ``gcs`` for array data on gs://
    (``ORBAX_PATHWAYS_GCS_GRPC=1``; off). Same objects on storage; needs a tensorstore build with
    the gRPC driver and real GCS (emulators speak HTTP only).
  storage_retries: retries of one GCS request before a save or restore fails
    (``ORBAX_PATHWAYS_STORAGE_RETRIES``); None keeps tensorstore's default (32, backoff to 32 s).
    Lower it to fail fast when storage is down.
  request_deadline_floor_s, request_deadline_cap_s: every storage request we issue (array
    reads and writes, our records and index) gets a deadline from what this process observed
    (p90 latency of small requests plus the request's bytes, and those queued ahead of it, at the
    observed throughput; times 4), clamped to [floor, cap]
    (``ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S``, 10 s; ``..._CAP_S``, 120 s). A read past its
    deadline gets a second identical request (the first complete answer wins, its checksums
    still verified); a write is written again (object writes are idempotent); after 3 requests
    past their deadlines the save or restore fails naming the object (``storage/hedge.py``).
    The floor and cap are the handler's: they apply to its calls only (what was observed is the
    process's).

  The node-local tier: each host's copy of what it wrote, read first on restore.
  tier_dir: the node-local tier (``ORBAX_PATHWAYS_TIER_DIR``): a directory on node-local
    memory (tmpfs) where every save also leaves, in its background part, a copy of the chunks
    this host wrote (same bytes, same crc32c as on storage), which a restore of that committed
    step reads before storage. A directory set here (or in the variable) is always used. None
    (default): ``ORBAX_PATHWAYS_TIER_DIR`` where the node sets it (also for ``Options(...)``
    built in code: the RAM disk is the node's), else ``/dev/shm/orbax-pathways-<uid>`` when
    /dev/shm is a tmpfs, only where a copy saves a storage read on a restart: a checkpoint
    directory on gs:// (or a network filesystem), a job of several processes, or Pathways
    workers (colocated transport). A one-process job saving to this machine's own disk gets no
    tier by default: the page cache already serves its restart, and a copy would hold node
    memory for a day (``tier.config.default_applies``). The default leaves 64 MiB free on its
    filesystem. ``'off'``: no tier. The directory must be this user's and not writable by
    other users (created ``0700``, files ``0600``, no symlink followed); another user's is
    refused with one warning. A tier that would not fit (after dropping this checkpoint
    directory's older steps), or a read-only or full directory, is skipped with one warning; it
    never fails or slows a save. What a host keeps: ``tier_scope``. Not part of the
    checkpoint: storage stays the truth, and ``orbax-pathways verify`` checks it (a restore the
    tier serves does not read storage's copy) (``docs/format.md``, "The node-local tier").
  tier_keep: committed steps the tier keeps per checkpoint directory (``ORBAX_PATHWAYS_TIER_KEEP``,
    1); a step's copy is dropped once a newer step's copy is complete and that step committed.
  tier_scope: what the tier keeps (``ORBAX_PATHWAYS_TIER_SCOPE``). ``'written'`` (default): the
    chunks this host wrote, from the buffers the storage write used: no extra device-to-host
    bytes, ``save()`` blocking unchanged; a replica another host wrote is not kept, so a lost
    host's share of replicated state is read from storage. ``'held'``: also every whole chunk
    this host's devices hold that another host writes (replicated state then survives the loss
    of any host), at the cost of copying those replicas to the host inside ``save()`` and
    keeping them in node memory.
  tier_max_age_s, tier_max_bytes: node-level clean-up of the tier (``tier/gc.py``). At the
    first tier copy of each save, entries whose step is gone from a local checkpoint directory
    (or the directory itself) are dropped (``mngr.delete`` and retention drop theirs at once;
    ``orbax-pathways tier --gc`` also lists gs:// directories and drops stale entries), and
    entries of *other* checkpoint directories in the same tier
    directory are dropped once nothing wrote, committed or restored from them for
    ``tier_max_age_s`` (``ORBAX_PATHWAYS_TIER_MAX_AGE_S``, 24 h; ``inf``: never by age); then,
    while the tier holds more than ``tier_max_bytes`` (``ORBAX_PATHWAYS_TIER_MAX_BYTES``; None:
    half the size of its filesystem), the oldest entries, other directories' first, then this
    directory's steps older than its newest committed one. An entry touched in the last 5
    minutes (``tier.gc.IDLE_S``: a save or restore may be using it) is never dropped. Node
    steps (``local_steps_in='nodes'``) count against the cap, which never drops them (their
    manager keeps ``local_steps_keep``); a stopped job's go after ``tier_max_age_s``.
  tier_peer_timeout_s: under multi-controller JAX a restore takes a chunk this node's tier lacks
    from another host's tier (over a TCP connection to that process) before storage; this is
    the longest wait on that host, per request (``ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S``, 20 s;
    shorter than ``peer_timeout_s``: storage still has every chunk, so a slow peer costs little). Past
    it, that host's chunks come from storage (one log line naming it); the restore never fails
    for it.

  Multi-tier checkpointing: local-only steps between storage steps.
  local_save_interval_steps: multi-tier checkpointing (``docs/multi_tier.md``;
    ``ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS``, 0: off). A step a ``CheckpointManager``'s own
    policy declines whose number is a multiple of this is saved *local-only*: Orbax's files and
    our records to ``<directory>/.orbax-pathways-local/<step>`` in storage, the array bytes to the
    writer hosts' node-local tiers only. ``preemption.resume`` restores the newest step, local-only
    or in storage, that the live processes can complete. Needs the tier (``tier_dir``). Each
    local-only save still runs Orbax's save protocol for those small files (storage round trips
    one after another: about 1 s to commit at 30 ms a request, 4 processes, 64 arrays), so a
    local interval shorter than that makes saves queue (``local_save_when_busy``).
  local_steps_keep: local-only steps kept per checkpoint directory (multi-tier,
    ``local_save_interval_steps``; ``ORBAX_PATHWAYS_LOCAL_STEPS_KEEP``). None (default): as
    many as ``tier_keep``. A retention of its own: the tier's copies of storage steps follow
    ``tier_keep``, the local-only steps (and node steps) this. A node holds at least two node
    steps whatever it says (``multitier/node_layout.kept``); listings show this many.
  local_steps_in: where a local-only step's Orbax files and records go
    (``ORBAX_PATHWAYS_LOCAL_STEPS_IN``). ``'nodes'`` (default): each process saves its part of
    the step alone into its node's tier
    directory (``tier_dir``, which must be named; the emergency manager's ``local_directory``),
    every shard it holds, in Orbax's format (``multitier/node_steps.py``): no storage request,
    no barrier, and storage saves never wait for it. ``preemption.resume`` (and the emergency
    manager's restart) restores the newest step every process can restore, each process from
    its own node, or from its partner's copy when its node is new (``local_copies=2``). For
    trees of ``jax.Array``, numpy and scalar leaves, and JSON, from v0, v1's
    ``training.Checkpointer`` and the emergency drop-in (other arguments, and Pathways, keep
    ``'storage'``); a resume onto another process count restores them from the parts the live
    nodes hold (``docs/multi_tier.md``). ``'storage'``: the step's Orbax files and records go
    to storage, its bytes to the tiers, as ``local_save_interval_steps`` says.
  local_save_when_busy: a local-only save due while this manager's previous one is still busy
    in the background (``ORBAX_PATHWAYS_LOCAL_SAVE_WHEN_BUSY``). ``'wait'`` (default): ``save()``
    takes the snapshot once the previous save's writes on this process are done (its host
    copies consumed), not its commit, and the new save starts committing after it: one save
    commits and at most one waits behind it, never more than one save's host copies held at
    once; a loop whose local interval is shorter than a commit is held to the commits' pace.
    ``'skip'``: the step is not saved local-only and ``save()`` returns at once; under
    multi-controller JAX the primary host decides for every process (one key-value round per
    local-only step: every process skips the same steps). For a local interval much shorter
    than a local save's commit: the loop never waits, and local-only steps land as often as
    they can commit. Only where local-only saves run in the background (the in-process transport,
    arguments the save can copy); otherwise every due step is saved.
  local_copies: copies of each host's share of a local-only step (``ORBAX_PATHWAYS_LOCAL_COPIES``,
    1). ``2``: each process also sends its share, in the save's background part, to a partner
    process of another slice (``fleet/partners.py``), which keeps it in its node's tier, so the
    step survives the loss of any one slice even where state is sharded across every device.
    Costs each node its partner's share in node memory and one copy over the network per save.
    Multi-controller JAX only (under Pathways: not yet); a copy that cannot be made (no other
    slice, a partner's full tier) is one warning, and the step keeps one copy. Node steps
    (``local_steps_in='nodes'``) are copied whole into the partner's node, and a resume
    fetches a lost node's part back from there.

  Other processes and workers.
  peer_timeout_s: how long a wait on other processes or workers may last beyond the work this
    process saw (``ORBAX_PATHWAYS_PEER_TIMEOUT_S``, 60 s). A multi-process save: once this
    process's writes finished, the others must report theirs within this plus the time this
    process's own writes took; the primary host's commit must keep showing progress at least
    this often. A colocated call: it may go this long plus its busiest worker host's bytes at a
    conservative rate without a sign of progress (a worker starting, finishing an array or its
    share; a result becoming ready), however long it runs in all. Past it, the save
    (``PeerLostError``, a ``SaveError``) or restore (``WorkerTimeoutError``) fails naming the
    processes or workers that went silent; the step
    is not committed. Keep it below ``jax.distributed``'s heartbeat timeout (100 s by default),
    which otherwise aborts every process with no Python error. A handler's colocated calls
    use its own; a multi-process save's liveness round uses the installed handler's (Orbax's
    async manager, which runs the round, does not know which handler wrote the save).
  """

  # Each default is its variable's (ENV_VARS, through FIELD_ENV): written once. The fields in
  # the docstring's groups (keyword-only: their order is not part of the API).

  # Bytes
  max_chunk_bytes: int = field_default('max_chunk_bytes')
  max_inflight_bytes: int = field_default('max_inflight_bytes')
  coalesce_bytes: int = field_default('coalesce_bytes')
  snapshot: str = field_default('snapshot')
  compression: str = field_default('compression')
  verify_checksums: bool = field_default('verify_checksums')
  replica_parallel: bool = True  # no variable: Orbax's own use_replica_parallel decides too

  # Topology
  transport: str | None = field_default('transport')
  num_slices: int | None = field_default('num_slices')
  divisibility: str = field_default('divisibility')

  # Storage requests
  gcs_grpc: bool = field_default('gcs_grpc')
  storage_retries: int | None = field_default('storage_retries')
  request_deadline_floor_s: float = field_default('request_deadline_floor_s')
  request_deadline_cap_s: float = field_default('request_deadline_cap_s')

  # The node-local tier
  tier_dir: str | None = field_default('tier_dir')
  tier_keep: int = field_default('tier_keep')
  tier_scope: str = field_default('tier_scope')
  tier_max_age_s: float = field_default('tier_max_age_s')
  tier_max_bytes: int | None = field_default('tier_max_bytes')
  tier_peer_timeout_s: float = field_default('tier_peer_timeout_s')

  # Multi-tier checkpointing
  local_save_interval_steps: int = field_default('local_save_interval_steps')
  local_steps_keep: int | None = field_default('local_steps_keep')
  local_steps_in: str = field_default('local_steps_in')
  local_save_when_busy: str = field_default('local_save_when_busy')
  local_copies: int = field_default('local_copies')

  # Other processes and workers
  peer_timeout_s: float = field_default('peer_timeout_s')

  def compress(self, dtype, requested: bool) -> bool:
    """Whether to zstd-compress an array of ``dtype`` when the checkpoint handler asks
    ``requested`` (Orbax's ``use_compression``)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    if not requested or self.compression == 'none':
      return False
    if self.compression == 'zstd':
      return True
    name = np.dtype(dtype).name  # ml_dtypes (bfloat16, float8_*, int4) are numpy kind 'V'
    return not (np.issubdtype(np.dtype(dtype), np.inexact) or name.startswith(('float', 'bfloat')))

  def ts_context_extra(self) -> dict:
    """Tensorstore context resources these options add to Orbax's defaults."""
    if self.storage_retries is None:
      return {}
    return {'gcs_request_retries': {'max_retries': self.storage_retries,
                                    'initial_delay': '0.1s', 'max_delay': '2s'}}

  def __post_init__(self):
    if self.transport is not None:
      object.__setattr__(self, 'transport', former_transport(self.transport, 'Options.transport'))
    for name, allowed in (('divisibility', DIVISIBILITIES), ('compression', COMPRESSIONS),
                          ('snapshot', SNAPSHOTS), ('tier_scope', TIER_SCOPES),
                          ('local_save_when_busy', LOCAL_WHEN_BUSY),
                          ('local_steps_in', LOCAL_STEPS_IN)):
      if getattr(self, name) not in allowed:
        quoted = [repr(a) for a in allowed]
        raise ValueError(f'{name}={getattr(self, name)!r}: use {", ".join(quoted[:-1])} or '
                         f'{quoted[-1]}.')
    if self.transport is not None and self.transport not in TRANSPORTS:
      raise ValueError(f'Options.transport={self.transport!r}: use one of {list(TRANSPORTS)}, '
                       'or None to detect.')
    _check_int('max_chunk_bytes', self.max_chunk_bytes, 1)
    _check_int('max_inflight_bytes', self.max_inflight_bytes, 1)
    _check_int('coalesce_bytes', self.coalesce_bytes, 0)
    _check_int('storage_retries', self.storage_retries, 0, optional=True)
    _check_int('num_slices', self.num_slices, 1, optional=True)
    _check_int('tier_keep', self.tier_keep, 1)
    _check_int('local_steps_keep', self.local_steps_keep, 1, optional=True)
    _check_int('local_save_interval_steps', self.local_save_interval_steps, 0)
    _check_int('local_copies', self.local_copies, 1)
    if self.local_copies > 2:
      raise ValueError(f'Options.local_copies={self.local_copies!r}: use 1 or 2 (a second copy '
                       'on a partner host of another slice).')
    _check_int('tier_max_bytes', self.tier_max_bytes, 0, optional=True)
    age = self.tier_max_age_s
    if isinstance(age, bool) or not isinstance(age, (int, float)) or not age >= 0:
      raise ValueError(f'Options.tier_max_age_s={age!r}: use a number of seconds >= 0 '
                       '(float("inf"): never drop by age).')
    tier_peer = self.tier_peer_timeout_s
    if isinstance(tier_peer, bool) or not isinstance(tier_peer, (int, float)) or not tier_peer > 0:
      raise ValueError(f'Options.tier_peer_timeout_s={tier_peer!r}: use a number of seconds > 0.')
    if self.tier_dir is not None and not isinstance(self.tier_dir, str):
      raise ValueError(f'Options.tier_dir={self.tier_dir!r}: use a directory path (str), '
                       '"off", or None for the /dev/shm default.')
    floor, cap = self.request_deadline_floor_s, self.request_deadline_cap_s
    if (isinstance(floor, bool) or isinstance(cap, bool)
        or not isinstance(floor, (int, float)) or not isinstance(cap, (int, float))
        or not 0 < floor <= cap):
      raise ValueError(f'Options.request_deadline_floor_s={floor!r}, request_deadline_cap_s='
                       f'{cap!r}: need numbers with 0 < floor <= cap (seconds).')
    peer = self.peer_timeout_s
    if isinstance(peer, bool) or not isinstance(peer, (int, float)) or not peer > 0:
      raise ValueError(f'Options.peer_timeout_s={peer!r}: need a number of seconds > 0.')

  @classmethod
  def from_env(cls, environ: Mapping[str, str] | None = None) -> 'Options':
    """Options from the ``ORBAX_PATHWAYS_*`` variables (defaults where unset); a malformed
    value raises ValueError naming the variable, the value and the accepted values."""
    return cls(**{field: env_value(name, environ) for field, name in FIELD_ENV.items()})


_fields_init = Options.__init__  # the dataclass's own


def _init(self: Options, **kwargs: Any) -> None:
  """``Options(...)``: the dataclass's ``__init__``, taking a former option name
  (``FORMER_FIELDS``) for its current one, with one ``DeprecationWarning``."""
  for old, new in FORMER_FIELDS.items():
    if old in kwargs:
      if new in kwargs:
        raise TypeError(f'Options: {old}= is the former name of {new}=; pass {new}= alone.')
      warnings.warn(f'orbax_pathways: Options.{old} is now Options.{new}; the former name will '
                    'go away in a later release.', DeprecationWarning, stacklevel=2)
      kwargs[new] = kwargs.pop(old)
  _fields_init(self, **kwargs)


Options.__init__ = _init  # type: ignore[method-assign]


def _former(new: str) -> property:
  """A read-only attribute under a former name (``FORMER_FIELDS``) that reads ``new``."""

  def read(self: Options) -> Any:
    return getattr(self, new)

  return property(read, doc=f'The former name of ``{new}``.')


for _old, _new in FORMER_FIELDS.items():
  setattr(Options, _old, _former(_new))
