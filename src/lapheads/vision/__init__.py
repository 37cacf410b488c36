"""Vision pieces shared by the vision recipes, the probes and the geometry of vision runs.

- ``transforms``: DeiT-3's 3-Augment and evaluation transform, DINO's multi-crop, the probes'
  evaluation transform, the ImageNet statistics (torchvision's ``transforms.v2`` API only).
- ``backbones``: frozen timm ViT backbones (no classifier, dynamic image size) and their metadata.
- ``probes``: weighted k-NN, linear probe and linear segmentation probe on frozen features.
"""
