"""comfy_aimdo.storage on vpager: what kind of disk a model file is on.

fast_disk(path) answers True (fast local storage), False (slow) or None
(cannot tell). The comfy_aimdo interface answers only on Windows; on Linux
the client decides from sysfs itself, so here the answer is always None.
Nothing is imported or probed, and no argument makes it raise.
"""

__all__ = ["fast_disk"]


def fast_disk(path=None, *args, **kwargs):
    """None: this implementation runs on Linux, where the client reads the
    block device's kind from sysfs itself. Never raises, whatever is
    passed."""
    return None
