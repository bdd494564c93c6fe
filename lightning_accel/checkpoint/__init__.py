"""Checkpointing, in one place: the layer just above ``utils``, below precision, strategies, callbacks and the shim.

- :mod:`.state_files`: Accelerate's ``save_state`` files (weights, optimizers, schedulers, samplers, loaders, scaler,
  random states, registered objects), written and read by functions that take explicit arguments;
- :mod:`.loaders`: where each prepared data loader stands, recorded and resumed;
- :mod:`.folders`: the atomic checkpoint folder (write to a temporary sibling, publish by rename, rotate);
- :mod:`.node_copies`: a checkpoint folder made complete on every node's own disk;
- :mod:`.weight_shards`: Hugging Face's sharded weights files (``save_model``);
- :mod:`.engines`: the engines' handlers of ``save_state`` (what a strategy's ``checkpoint_engine()`` returns) and
  DeepSpeed's layout;
- :mod:`.fsdp_layout`: the FSDP layout, for ``save_state`` and for Accelerate's ``save_fsdp_model`` & co.;
- :mod:`.fsdp_policy`: the one FSDP1/FSDP2 state-dict policy (honouring the plugin's state-dict configs);
- :mod:`.megatron`: ``acc_megatron_lm`` checkpoints independent of ``tp_degree``.

Accelerate's public names stay at Accelerate's paths (:mod:`lightning_accel.checkpointing`,
:mod:`lightning_accel.utils`, whose ``fsdp_utils`` wraps :mod:`.fsdp_layout`); this package is the machinery behind
them. The offline readers of checkpoints (``load_full_state_dict``) are in ``utils/modeling/checkpoint.py``, below.
"""
