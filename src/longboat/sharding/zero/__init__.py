"""Sharding stages 1 and 2 (ZeRO) inside data parallelism, riding on the collective engine's
reducer: ``Strategy(sharding=True)``; the settings are `longboat.sharding.config`.

Each module has one job:

- ``setup``: what sharding accepts and lays out once per world (`ShardSetup`), shared by the
  reducer and the step.
- ``layout``: which slice of each gradient bucket a rank owns, cut into pieces of parameters.
- ``groups``: the shard and replica process groups and their collectives.
- ``scatter``: stage 2's bucket collective, the reduce-scatter into this rank's slice.
- ``shard_optimizer``: the user's optimizer class over this rank's slices.
- ``held``: the shard optimizer's state per piece (shaped or scalar), read and written there.
- ``step``: the optimizer stage that steps the slices and gathers the parameters.
- ``gather`` and ``readers``: the all-gather of the parameters, and who reads which in a
  forward (``comm_overlap``).
- ``norms``: whole-parameter norms for LARS and LAMB over slices.
- ``clip``: the global gradient norm over slices.
- ``state``: ``state_dict`` in torch's unsharded layout, and back.
- ``slices``: a rank's slices in parameter coordinates, and how they fill another layout.
- ``files``: per-rank checkpoint files.
- ``memory``: bytes per rank.

See docs/sharding.md.
"""
