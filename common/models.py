"""The course's toy models.

Model code never imports ``torch.distributed``: parallelism is applied to a model from outside
(``DistributedDataParallel(model)``), so the same class serves every lesson.
"""

from torch import nn


class LeNet(nn.Module):
    """LeNet as in d2l's multi-GPU chapter, for 28x28 images.

    conv 20@3x3 -> ReLU -> avg-pool 2 -> conv 50@5x5 -> ReLU -> avg-pool 2 -> fc 800->128 -> ReLU -> fc 128->10.
    The 800 is 50 channels x 4 x 4, which only a 28x28 input gives: ``input_shape`` says so.
    """

    input_shape = (1, 28, 28)

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, kernel_size=3),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Conv2d(20, 50, kernel_size=5),
            nn.ReLU(),
            nn.AvgPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(50 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, X):
        return self.classifier(self.features(X))


class SimpleCNN(nn.Module):
    """Three conv-BatchNorm-ReLU-maxpool blocks (64, 128, 256 channels) and a dropout MLP head, for 32x32 images.

    BatchNorm keeps running statistics per process: under DDP each rank normalises with its own batch
    unless the model is converted with ``nn.SyncBatchNorm.convert_sync_batchnorm``.
    """

    input_shape = (3, 32, 32)

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()

        def block(c_in, c_out):
            return [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]

        self.features = nn.Sequential(*block(in_channels, 64), *block(64, 128), *block(128, 256))
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(256 * 4 * 4, 512),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(512, num_classes),
        )

    def forward(self, X):
        return self.classifier(self.features(X))


class DeepMLP(nn.Module):
    """A stack of ``depth`` equal blocks (Linear width->width, ReLU) between an input and an output Linear.

    Almost all of its weights sit in the blocks, which is what makes it the sharding lessons' model: FSDP
    shards each block on its own (``model.blocks``) and gathers one block at a time. The default (width 512,
    depth 4) has 1.46 M parameters: 5.8 MB of fp32 weights, 23 MB with gradients and Adam's two states.
    ``input_shape`` is LeNet's, so it trains on the same data.
    """

    input_shape = (1, 28, 28)

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 512, depth: int = 4):
        super().__init__()
        height, breadth = self.input_shape[1:]
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * height * breadth, width), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, X):
        X = self.stem(X)
        for block in self.blocks:
            X = block(X)
        return self.head(X)


MODELS = {"lenet": LeNet, "simplecnn": SimpleCNN, "mlp": DeepMLP}
"""Models by their command-line name; ``MODELS[name].input_shape`` is the (C, H, W) each one takes."""
