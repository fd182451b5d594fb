"""matplotlib for the commands' --plot flags: an optional dependency (`pip install 'mlx-flash-runtime[plot]'`)."""

from ..errors import FlashError


def pyplot(headless: bool = True):
    """matplotlib.pyplot, on the Agg backend when `headless` (files, no window; False keeps the caller's, e.g. a
    notebook's inline one). FlashError naming the extra to install when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise FlashError("plotting needs matplotlib: pip install 'mlx-flash-runtime[plot]' (or matplotlib)") from e
    if headless:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
