"""Data loaders: images (CIFAR, ImageFolder, idx, digits), text readers, token shards, benchmark files, segmentation."""
