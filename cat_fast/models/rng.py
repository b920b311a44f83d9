"""Saving and restoring the random-number generators (CPU and the tensor's CUDA device) without a device sync:
how the counterfactual passes replay the clean forward's dropout masks."""
import torch

__all__ = ["get_state", "set_state"]


def get_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_state(device, state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
