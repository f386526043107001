"""Model-level offloading on top of the Offloader: autograd and module hooks."""
from .activations import offload_activations

__all__ = ["offload_activations"]
