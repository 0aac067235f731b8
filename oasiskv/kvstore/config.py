"""Configuration of one KV store server (validated before any memory is taken)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 1 << 30
MAX_CAPACITY_GB = 1 << 26
# Every block's chunk in the arena is padded to this (layout.KVLayout.chunk_bytes), and an arena
# holds whole chunks.
CHUNK_ALIGN = 4096


class KVStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # Size of the preallocated arena. Give either capacity_bytes or capacity_gb; the default
    # (1 GiB) leaves plenty of a 2-core / 24 GiB machine to the model processes.
    # At most 64 PiB: beyond that (or inf) the arena's size overflowed inside the allocator.
    capacity_bytes: int = Field(default=GIB, gt=0, le=MAX_CAPACITY_GB * GIB)
    capacity_gb: Optional[float] = Field(default=None, gt=0, le=MAX_CAPACITY_GB, allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)  # 0: pick a free port
    # Address clients should use when host is a wildcard (0.0.0.0), e.g. the Ray node IP.
    advertise_host: Optional[str] = None

    # Tokens per block. Every request written to this store must use it, so a misconfigured
    # producer is refused at allocate() instead of corrupting reads later.
    block_size: int = Field(default=16, gt=0, le=4096)

    # A request nobody has touched (allocate/extend/read/write/touch) for ttl_s seconds is
    # freed: that is how the store recovers memory from clients that vanished.
    ttl_s: float = Field(default=600.0, gt=0)

    # Data plane offered to remote clients. "nixl" also serves TCP (clients choose);
    # "tcp" does not start a NIXL agent at all.
    transport: Literal["nixl", "tcp"] = "nixl"

    metrics_port: Optional[int] = Field(default=None, ge=0, le=65535)

    # Host memory: transparent huge pages make NIXL/CMA reads ~2x faster (fewer page pins);
    # prefault touches the whole arena at start so a too-large capacity fails now, not later.
    hugepages: bool = True
    prefault: bool = True
    pin_memory: Literal["auto", "yes", "no"] = "auto"

    # How often the store's NIXL agent is progressed. The target side must be progressed or
    # remote READs never complete; a poll every millisecond is enough and keeps a core free
    # (NIXL's own progress thread busy-polls a whole core).
    nixl_poll_interval_s: float = Field(default=0.001, gt=0, le=1.0)

    # A request frame must arrive whole within this time of its first byte, and a reply must be
    # sent whole within it, or the connection is dropped (a peer that trickles bytes must not keep
    # the request it pinned); a new connection must send its first frame within it too.
    frame_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=256, gt=0)

    @model_validator(mode="after")
    def _resolve_capacity(self) -> "KVStoreConfig":
        if self.capacity_gb is not None:
            resolved = int(self.capacity_gb * GIB)
            # The arena holds whole 4 KiB chunks: a smaller one was refused only when the store
            # started, as an error of starting it rather than of the setting.
            if resolved < CHUNK_ALIGN:
                raise ValueError(f"capacity_gb ({self.capacity_gb:g}) is under one {CHUNK_ALIGN}-byte chunk")
            # Bypass validate_assignment recursion: set through __dict__.
            self.__dict__["capacity_bytes"] = resolved
            self.__dict__["capacity_gb"] = None
        elif self.capacity_bytes < CHUNK_ALIGN:
            raise ValueError(f"capacity_bytes ({self.capacity_bytes}) is under one {CHUNK_ALIGN}-byte chunk")
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> "KVStoreConfig":
        if self.port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port ({self.port}) is the store's own port; the store and its /metrics need a port each")
        return self
