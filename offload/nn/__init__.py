"""Model-level offloading on top of the Offloader: autograd and module hooks."""
from .activations import offload_activations
from .parameters import OffloadedParameters, disk_offload, offload_parameters

__all__ = ["offload_activations", "offload_parameters", "OffloadedParameters", "disk_offload"]
