"""offload: move PyTorch tensors between memory and NVMe files asynchronously,
through io_uring with O_DIRECT (or a thread pool where io_uring is blocked)."""
from ._errors import OffloaderClosedError, OffloaderForkedError
from .handle import Handle
from .checkpoint import CheckpointError, load, load_async, save
from ._pool import buffer_pool
from .offloader import DiskOffloader, Offloader
from . import nn  # noqa: E402 (offload.nn: model-level hooks, built on the above)

__version__ = "0.1.0"
__all__ = ["Offloader", "DiskOffloader", "buffer_pool", "Handle", "OffloaderClosedError", "OffloaderForkedError",
           "save", "load", "load_async", "CheckpointError", "nn", "__version__"]
