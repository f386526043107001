"""A progress bar over bytes, for saves and loads that take a while."""
import sys


class ProgressBar:
    """A tqdm bar over bytes when asked (or stderr is a terminal and tqdm is installed)."""

    def __init__(self, enabled, total, description):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                if enabled is True:
                    raise
                return
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=description, file=sys.stderr)

    def update(self, n):
        if self.bar is not None:
            self.bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
