import numpy as np
import pytest

from app import models


def test_cnn_is_the_classic_network():
    model = models.build("cnn", (28, 28, 1), 10)
    # conv 5x5x32, conv 5x5x64, dense 7*7*64 -> 1024, dense 1024 -> 10
    expected = (5 * 5 * 32 + 32) + (5 * 5 * 32 * 64 + 64) + (3136 * 1024 + 1024) + (1024 * 10 + 10)
    assert model.count_params() == expected
    assert model(np.zeros((2, 28, 28, 1), np.float32)).shape == (2, 10)


def test_mlp_is_the_512_128_128_stack():
    model = models.build("mlp", (28, 28, 1), 10)
    assert [layer.units for layer in model.layers if hasattr(layer, "units")] == [512, 128, 128, 10]


def test_unknown_model():
    with pytest.raises(ValueError, match="Unrecognized model 'vgg'; choose cnn or mlp"):
        models.build("vgg", (28, 28, 1), 10)
