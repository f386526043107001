"""O_DIRECT's rules in one place: the block every offset and length is
rounded to, and what a file demands beyond it."""
from . import _core, _signals

# Pure arithmetic, but called from the Offloader's bookkeeping: an innermost
# frame here must hold a signal as the caller's would (offload/_signals.py).
_signals.bookkeeping_module(__file__)

BLOCK = 4096  # a page; O_DIRECT transfers start and end on it (more where a file asks)


def round_up(n: int, alignment: int = BLOCK) -> int:
    """The smallest multiple of ``alignment`` at or above ``n``."""
    return -(-n // alignment) * alignment


def round_down(n: int, alignment: int = BLOCK) -> int:
    """The largest multiple of ``alignment`` at or below ``n``."""
    return n // alignment * alignment


def file_alignment(fd: int) -> int:
    """What transfers on ``fd`` are aligned to: at least a block, more when
    the file's DIO memory or offset alignment (statx) asks for more."""
    memory, offset = _core.dio_alignment(fd)
    return max(BLOCK, memory, offset)
