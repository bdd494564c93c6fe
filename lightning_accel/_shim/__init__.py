"""The ``Accelerator`` shim's internals: what its public modules (``accelerator``, ``data_loader``, ...) build on.

- ``fabric``: picking the distributed type and building the Lightning ``Fabric`` for a run.
- ``module``: the module ``prepare`` returns; ``engine_step``: engines that step inside ``backward`` (DeepSpeed).
- ``process``: process information, decorators and triggers on the ``Accelerator``.
- ``loader_control``: the ``Accelerator``'s data-loader members (the loader classes and sharding are public, in
  :mod:`lightning_accel.data_loader`; resumable positions are recorded in checkpoints by
  :mod:`lightning_accel.checkpoint.loaders`).
- ``checkpoint_control``: ``save_state``/``load_state`` (the files are :mod:`lightning_accel.checkpoint`'s).

Nothing outside the shim imports this package.
"""
