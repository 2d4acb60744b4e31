"""Shared parts of the Fabric memory recipes: flags, data, models, the training loop, metrics, report."""
