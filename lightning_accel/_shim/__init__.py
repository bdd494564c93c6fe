"""The ``Accelerator`` shim's internals: what its public modules (``accelerator``, ``data_loader``, ...) build on.

- ``fabric``: picking the distributed type and building the Lightning ``Fabric`` for a run.
- ``module``: the module ``prepare`` returns; ``engine_step``: engines that step inside ``backward`` (DeepSpeed).
- ``process``: process information, decorators and triggers on the ``Accelerator``.
- ``loader_control``, ``loader_checkpoint``: the ``Accelerator``'s data-loader members and resumable positions (the
  loader classes and sharding are public, in :mod:`lightning_accel.data_loader`).
- ``checkpoint_control``, ``sharded_checkpoint``: ``save_state``/``load_state`` and the strategies' sharded files.

Nothing outside the shim imports this package.
"""
