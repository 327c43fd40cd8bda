"""Calls of this process's C library that Python's ``os`` lacks (``mallopt``,
``malloc_trim``, ``sync_file_range``, ``prctl``), looked up in one handle: the process's
own symbols (``ctypes.CDLL(None)``), not ``ctypes.util.find_library``, which runs
``ldconfig -p`` in a child process."""
from __future__ import annotations

import ctypes

_handle: ctypes.CDLL | None = None


def function(name: str, argtypes: tuple | None = None, restype=ctypes.c_int):
    """The C library's ``name``, its arguments typed ``argtypes`` (None: left untyped, as
    a variadic one must be) and its result ``restype``; None where this platform or C
    library has no such function. ``ctypes.get_errno()`` reads its errno."""
    global _handle
    try:
        if _handle is None:
            _handle = ctypes.CDLL(None, use_errno=True)
        fn = getattr(_handle, name)
    except (OSError, AttributeError, TypeError):
        return None
    if argtypes is not None:
        fn.argtypes = argtypes
    fn.restype = restype
    return fn
