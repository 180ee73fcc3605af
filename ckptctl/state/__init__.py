"""Turning a training state (modules, optimizers, stateful objects, nested containers) into
named tensors plus JSON, and back. Shared by the save and load paths."""
