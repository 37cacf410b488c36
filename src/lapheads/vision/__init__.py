"""Vision pieces shared by the vision recipes, the probes and the geometry of vision runs: transforms, frozen
timm backbones, probes on frozen features."""
