"""Hydra configs, shipped in the wheel as the package ddptrain.conf."""
