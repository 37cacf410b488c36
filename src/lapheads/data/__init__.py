"""Data loaders: images (CIFAR, ImageFolder, idx, digits), text and token shards, benchmark files, segmentation."""
