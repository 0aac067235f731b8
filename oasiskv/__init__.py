"""OasisKV: full KV in a host-memory store, a predicted sparse working set on the decode device."""

__version__ = "0.1.0"
