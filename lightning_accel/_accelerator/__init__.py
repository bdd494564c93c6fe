"""The ``Accelerator``'s collaborators: what :mod:`lightning_accel.accelerator`'s facade delegates to.

Each is built once in ``Accelerator.__init__`` and receives what it reads as keyword-only constructor arguments; none
reads the ``Accelerator``. The prepared objects are held by one :class:`~.prepared.PreparedObjects`.

- ``checkpoints``: ``Checkpoints``, ``save_state``/``load_state``/``save_model`` and the hooks (the files are
  :mod:`lightning_accel.checkpoint`'s).
- ``data_loaders``: ``DataLoaders``, preparing loaders for this process's shard and joining uneven inputs (the loader
  classes and sharding are public, in :mod:`lightning_accel.data_loader`).
- ``precision``: ``KwargsHandlers`` (Accelerate's handler attributes) and ``MixedPrecision`` (fp8 backend, scaler).
- ``parallelism``: ``Parallelism``, the mesh ranks and the context-parallel block; the tensor-parallel plan.
- ``process``: ``Trigger`` and the main-process decorators; ``gradients``: clipping and unscaling.
- ``fabric``: picking the distributed type and building the Lightning ``Fabric`` for a run.
- ``module``: the module ``prepare`` returns; ``engine_step``: engines that step inside ``backward`` (DeepSpeed).

Nothing outside the ``Accelerator`` imports this package.
"""
