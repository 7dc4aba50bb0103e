"""The base of every Python object that owns a C object (a handle)."""

import weakref

from .errors import closed_error

__all__ = ["Handle"]


class Handle:
    """Owns one C object and frees it exactly once: close(), the context
    manager, or __del__ as a last resort (which never raises).

    A handle whose parent frees it in C (a device closing its VBARs, a VBAR
    destroying its weights) is marked closed without a second free. Using a
    closed handle raises vpager.HandleError.
    """

    _closed = True      # until __init__ has made the C object
    _kind = "handle"

    def _init_handle(self, h, parent=None):
        self._h = h
        self._children = weakref.WeakSet()
        self._keep = []         # Python objects C may still point into
        self._parent = parent   # strong: a parent outlives its children
        if parent is not None:
            parent._children.add(self)
        self._closed = False

    # --- subclasses
    def _free(self):
        """Free the C object (raise on failure: the handle stays open)."""
        raise NotImplementedError

    # --- public
    @property
    def closed(self):
        return self._closed

    @property
    def id(self):
        """The C handle's id (0 never names an object)."""
        return self._handle().id

    def close(self):
        """Free the C object. A second close does nothing."""
        if self._closed:
            return
        self._free()
        self._mark_closed()

    def __enter__(self):
        self._handle()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except BaseException:
            # The C object stays until its device closes; never raise here.
            pass

    def __repr__(self):
        if self._closed:
            return "<vpager.%s closed>" % type(self).__name__
        return "<vpager.%s id=0x%x>" % (type(self).__name__, self._h.id)

    # --- internals
    def _handle(self):
        """The C handle value; HandleError once closed."""
        if self._closed:
            raise closed_error("this vpager.%s" % type(self).__name__)
        return self._h

    def _mark_closed(self):
        """The C object is gone (freed here or by a parent)."""
        if self._closed:
            return
        self._closed = True
        for child in list(self._children):
            child._mark_closed()
        self._children = weakref.WeakSet()
        self._keep = []             # lets go of buffers C pointed into
        if self._parent is not None:
            self._parent._children.discard(self)
