import inspect

import accelerate
import pytest

from lightning_accel import Accelerator
from lightning_accel.utils import DataLoaderConfiguration, ParallelismConfig


def test_positional_order_is_accelerates():
    ours = list(inspect.signature(Accelerator.__init__).parameters)
    theirs = list(inspect.signature(accelerate.Accelerator.__init__).parameters)
    assert ours == theirs


def test_split_batches_is_deprecated_but_applied():
    with pytest.warns(FutureWarning, match="DataLoaderConfiguration"):
        accelerator = Accelerator(cpu=True, split_batches=True)
    assert accelerator.split_batches is True
    assert accelerator.dataloader_config.split_batches is True


def test_split_batches_next_to_a_dataloader_config_raises():
    with pytest.raises(ValueError, match="inside dataloader_config"):
        Accelerator(cpu=True, split_batches=True, dataloader_config=DataLoaderConfiguration())


@pytest.mark.parametrize("argument", ["deepspeed_plugins"])
def test_unsupported_plugins_raise_naming_the_argument(argument):
    with pytest.raises(NotImplementedError, match=argument):
        Accelerator(cpu=True, **{argument: ParallelismConfig()})
