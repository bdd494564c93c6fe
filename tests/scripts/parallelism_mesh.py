"""2 CPU processes: ParallelismConfig(dp_shard_size=2) builds the mesh with the joint dimensions Accelerate flattens."""

import torch.distributed as dist

from lightning_accel.parallelism_config import ParallelismConfig

dist.init_process_group("gloo")
config = ParallelismConfig(dp_shard_size=2)
mesh = config.get_device_mesh("cpu")
assert config.get_device_mesh() is mesh
assert mesh.mesh_dim_names == ("dp_shard",), mesh.mesh_dim_names
sizes = [mesh[name].size() for name in ("dp_shard", "dp", "dp_shard_cp", "dp_cp")]
assert sizes == [2, 2, 2, 2], sizes
dist.destroy_process_group()
