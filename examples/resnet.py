"""A factory for ``memfit profile``: the model and one batch, as you would write for your own model.

    memfit profile examples/resnet.py:make
    memfit profile examples/resnet.py:make --budget 256MiB --json

The factory takes no arguments and returns ``(model, example_inputs)``; ``example_inputs`` is a
tensor, a tuple of positional arguments or a dict of keyword arguments. The batch size of the
example inputs is where the largest-batch search (``--budget``) starts.
"""

import torch

from memfit.bench.resnet import cifar_resnet


def make():
    torch.manual_seed(0)
    model = cifar_resnet(3, width=16)  # ResNet-20
    images = torch.randn(32, 3, 32, 32)
    return model, images
