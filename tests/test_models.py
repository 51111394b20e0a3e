import pytest
import torch
from torch import nn

from common.models import MODELS, LeNet, SimpleCNN


@pytest.mark.parametrize("name", MODELS)
def test_model_takes_its_input_shape_and_gives_ten_logits(name):
    model_class = MODELS[name]
    assert model_class()(torch.randn(4, *model_class.input_shape)).shape == (4, 10)


def test_in_channels_and_num_classes_are_arguments():
    assert LeNet(in_channels=3, num_classes=7)(torch.randn(2, 3, 28, 28)).shape == (2, 7)
    assert SimpleCNN(in_channels=1, num_classes=5)(torch.randn(2, 1, 32, 32)).shape == (2, 5)


def test_lenet_has_the_layers_of_d2l():
    shapes = [tuple(p.shape) for p in LeNet().parameters()]
    assert shapes == [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (128, 800), (128,), (10, 128), (10,)]
    assert sum(isinstance(m, nn.AvgPool2d) for m in LeNet().modules()) == 2


def test_simplecnn_has_three_batchnorms_that_convert_to_syncbatchnorm():
    model = SimpleCNN()
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 3
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in converted.modules()) == 3


def test_lenet_rejects_a_wrong_image_size():
    with pytest.raises(RuntimeError):
        LeNet()(torch.randn(1, 1, 32, 32))
