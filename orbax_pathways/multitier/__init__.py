"""Multi-tier checkpointing (``docs/multi_tier.md``): local-only steps in node memory between
storage steps, and the resume that picks the newest step the live processes can complete.

Modules, each one job:

- ``local_steps``: the manager hooks that save a declined step local-only, in the background
  (the hidden manager of its records in storage, or node steps).
- ``node_steps``: a local-only step saved by each process alone into its node
  (``Options.local_steps_in='nodes'``), and its resume.
- ``node_loop_items``: a node step's items only their own handler can save (a data
  iterator's), saved in the loop's thread and moved into the step by its save.
- ``local_busy``: a local-only save due while the previous one is busy: wait or skip, every
  process alike.
- ``local_detach``: the arguments of a background local-only save, detached from the loop.
- ``trailing_deleter``: the hidden manager's retention, on a thread after each commit.
- ``resume``: ``preemption.resume``: the newest complete step that restores, storage steps,
  local-only steps and node steps alike, every process agreeing on each step tried.
- ``resume_args``: a resume's ``args=`` (every item's restore arguments: a data iterator beside
  the state) as its one tree and the other items.
- ``emergency``: Orbax's emergency ``CheckpointManager`` as a drop-in on this path.
"""
