"""A stand-in for the part of torchvision that diffusers' training scripts use, shared by both sides.

torchvision's wheels on the package index are built against the CUDA build of torch; with the CPU torch 2.13 here
``import torchvision`` fails (``operator torchvision::nms does not exist``). The scripts only need
``torchvision.transforms`` to turn PIL images into normalised tensors, so this package provides exactly those
transforms (``transforms.py``), deterministic or drawing from torch's generator as torchvision's do. The client's one
patch of the upstream scripts (``run_client.py``, the same on both sides) imports it in place of torchvision:
``from torchvision import transforms`` becomes ``from torchvision_standin import transforms``. Nothing else sees it,
so transformers, diffusers and torchmetrics find no torchvision, as on a machine without it.
"""
