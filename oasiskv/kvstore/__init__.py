"""Host-memory store of every request's full KV cache and key summaries.

Public API:
    KVLayout, KVStoreConfig, KVStore, KVStoreServer, KVStoreClient, connect, TransferHandle,
    summarize_keys / summarize_layer / summarize_request / block_scores / rank_blocks / narrow_summaries, pack_layer / pack_request,
    errors (StoreFull, UnknownRequest, ...), launch_store_actor (Ray).
"""

from .client import KVStoreClient, connect
from .config import KVStoreConfig
from .errors import (
    BlockOutOfRange,
    InvalidArgument,
    KVStoreError,
    ProtocolError,
    RemoteError,
    RequestExists,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
    TransferError,
    UnknownRequest,
)
from .hostmem import alloc_host_buffer
from .layout import KVLayout, pack_layer, pack_request, unpack_units
from .ray_actor import KVStoreActor, launch_store_actor
from .server import KVStoreServer
from .store import KVStore, RequestInfo, StoreStats
from .summary import (
    DEFAULT_SUMMARY_KIND,
    RANKING_RADIUS_WEIGHTS,
    SUMMARY_KINDS,
    QuantizedSummaries,
    block_scores,
    narrow_summaries,
    quantize_summaries,
    rank_blocks,
    ranking_radius_weight,
    summarize_keys,
    summarize_layer,
    summarize_request,
)
from .transport import TransferHandle

__all__ = [
    "DEFAULT_SUMMARY_KIND", "RANKING_RADIUS_WEIGHTS", "SUMMARY_KINDS", "BlockOutOfRange", "InvalidArgument", "KVLayout", "KVStore", "KVStoreActor", "KVStoreClient",
    "KVStoreConfig", "KVStoreError", "KVStoreServer", "ProtocolError", "QuantizedSummaries", "RemoteError", "RequestExists",
    "RequestInfo", "StoreFull", "StoreStats", "StoreTimeout", "StoreUnavailable", "TransferError",
    "TransferHandle", "UnknownRequest", "alloc_host_buffer", "block_scores", "connect",
    "launch_store_actor", "narrow_summaries", "pack_layer", "pack_request", "quantize_summaries", "rank_blocks", "ranking_radius_weight", "summarize_keys", "summarize_layer",
    "summarize_request", "unpack_units",
]
