"""Named errors of the KV store.

Every error a caller can act on has its own type, carries its numbers in `fields`, and crosses
the wire as a structured error frame (`to_wire` / `from_wire`) so a remote client re-raises the
same type the store raised.
"""

from __future__ import annotations

from typing import Any


class KVStoreError(Exception):
    """Base of all store errors. `fields` holds the machine-readable details."""

    def __init__(self, message: str, **fields: Any):
        super().__init__(message)
        self.message = message
        self.fields = fields

    def __getattr__(self, name: str) -> Any:
        # Lets callers write err.needed_bytes instead of err.fields["needed_bytes"].
        fields = self.__dict__.get("fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    def __reduce__(self):
        # Keeps the error picklable for Ray, which ships exceptions between processes.
        return (_rebuild, (type(self).__name__, self.message, self.fields))

    def to_wire(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "message": self.message, "fields": self.fields}

    @staticmethod
    def from_wire(error: dict[str, Any]) -> "KVStoreError":
        cls = _ERROR_TYPES.get(str(error.get("type")), RemoteError)
        return cls(str(error.get("message", "")), **dict(error.get("fields") or {}))


class StoreFull(KVStoreError):
    """Admission refused: the request needs more bytes than the store has free."""


class UnknownRequest(KVStoreError):
    """The request id was never allocated, was freed, or expired (TTL)."""


class RequestExists(KVStoreError):
    """allocate() for a request id that is already live."""


class BlockOutOfRange(KVStoreError):
    """A layer, KV head, block or buffer slot index outside the request's / buffer's range."""


class InvalidArgument(KVStoreError):
    """Malformed call: wrong shapes, dtypes, sizes, unsupported layout."""


class StoreTimeout(KVStoreError):
    """A wait ran past its timeout. The store may be alive but slow, or gone."""


class StoreUnavailable(KVStoreError):
    """The store cannot be reached, closed the connection, or was restarted."""


class ProtocolError(KVStoreError):
    """A frame that does not parse: bad magic, oversized or truncated."""


class TransferError(KVStoreError):
    """The data plane (NIXL) reported a failed transfer."""


class RemoteError(KVStoreError):
    """An unexpected error inside the store; the message carries its description."""


_ERROR_TYPES: dict[str, type[KVStoreError]] = {
    cls.__name__: cls
    for cls in (
        KVStoreError,
        StoreFull,
        UnknownRequest,
        RequestExists,
        BlockOutOfRange,
        InvalidArgument,
        StoreTimeout,
        StoreUnavailable,
        ProtocolError,
        TransferError,
        RemoteError,
    )
}


def _rebuild(type_name: str, message: str, fields: dict[str, Any]) -> KVStoreError:
    return _ERROR_TYPES.get(type_name, RemoteError)(message, **fields)
