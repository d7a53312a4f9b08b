"""The run directory: its lock, the checkpoint store, final weights, resume checks and fingerprints.

Training writes a run directory through this package; serving, export and `load_model` read one
through it, without importing the training loop.
"""
