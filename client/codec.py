"""Value codecs: how the client turns application values into CHP value blobs and back.

* ``bytes`` (the default): identity. Values are ``bytes`` (``bytearray``/``memoryview``
  are accepted on ``set`` and copied to ``bytes``).
* ``msgpack`` (opt-in, ``codec="msgpack"``): any msgpack-serialisable Python value
  (None, bool, int, float, str, bytes, list, dict...). Tuples come back as lists.

On the wire an empty value means "delete" (12/CHP), so a codec must never encode a value
to ``b""``: ``bytes`` refuses an empty value on ``set`` (use ``delete``); msgpack never
produces an empty encoding. Pure: no sockets.
"""
from __future__ import annotations

from typing import Any, Protocol

import msgpack


class Codec(Protocol):
    name: str

    def encode(self, value: Any) -> bytes: ...

    def decode(self, blob: bytes) -> Any: ...


class BytesCodec:
    name = "bytes"

    @staticmethod
    def encode(value: Any) -> bytes:
        if isinstance(value, bytes):
            blob = value
        elif isinstance(value, (bytearray, memoryview)):
            blob = bytes(value)
        else:
            raise TypeError(f"the bytes codec takes bytes, not {type(value).__name__} "
                            "(use codec='msgpack' for Python values)")
        if not blob:
            raise ValueError("an empty value means delete in 12/CHP: use delete()")
        return blob

    @staticmethod
    def decode(blob: bytes) -> bytes:
        return blob


class MsgpackCodec:
    name = "msgpack"

    @staticmethod
    def encode(value: Any) -> bytes:
        try:
            return msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"value cannot be encoded with msgpack: {exc}") from None

    @staticmethod
    def decode(blob: bytes) -> Any:
        return msgpack.unpackb(blob, raw=False, strict_map_key=False)


CODECS: dict[str, Codec] = {"bytes": BytesCodec(), "msgpack": MsgpackCodec()}


def get_codec(codec: str | Codec) -> Codec:
    """A codec by name (``"bytes"``, ``"msgpack"``), or any object with encode/decode."""
    if isinstance(codec, str):
        try:
            return CODECS[codec]
        except KeyError:
            raise ValueError(f"unknown codec {codec!r}; known: {sorted(CODECS)}") from None
    if not (callable(getattr(codec, "encode", None)) and callable(getattr(codec, "decode", None))):
        raise TypeError(f"a codec needs encode() and decode(), got {codec!r}")
    return codec
