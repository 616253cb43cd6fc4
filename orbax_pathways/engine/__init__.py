"""The engine: the one save and restore path every front door calls (``core.py``: ``Engine``,
on the controller or each process), and the choice of transport for a runtime (``engine/runtime.py``).

The names below are the engine's interface to the front doors (``frontends/``), which import
this package; the code lives in ``core.py``.
"""

from orbax_pathways.engine.core import (  # noqa: F401  (the engine's interface)
    Engine, HostArray, PendingSave, RestoreLeaf, host_chunk_records, sharding_record,
    write_host_array)
