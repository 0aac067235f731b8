"""Starts (or joins) a Ray cluster and places the stores, prefill and decode workers."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from .config import ServeConfig
from .router import WorkerSlot

log = logging.getLogger("oasiskv.cluster")

# Health polls run on a thread of their own in each worker: behind a busy worker's queued
# prefills (or a blocked event loop) they would time out, and a busy worker would read as dead.
HEALTH_GROUP = "health"

ROLE_RESOURCES = {"prefill": "oasiskv_prefill", "decode": "oasiskv_decode", "store": "oasiskv_store"}


@dataclass
class ClusterHandles:
    prefill: list[WorkerSlot]
    decode: list[WorkerSlot]
    stores: list[WorkerSlot]


class NotEnoughGPUs(RuntimeError):
    """device='cuda' asks for more GPUs than the Ray cluster has: the actors would wait forever."""


class ClusterUnreachable(RuntimeError):
    """--address names a Ray cluster that does not answer: ray.init retries it for good."""


class WorkerStartFailed(RuntimeError):
    """A worker's constructor raised (a draft model that does not fit the target, a pool that
    does not fit the device...): the message is the worker's own exception, without Ray's
    traceback around it."""


class WorkersNotPlaced(WorkerStartFailed):
    """Workers still not ready when serve's start timeout ran out: Ray had no node with their
    resources (pods not yet scheduled, or none that match), or they were still loading."""


def _raised_in_worker(error_msg: str) -> str:
    """The exception line(s) at the end of the traceback text Ray carries for a failed actor
    constructor: everything after the last frame (`  File ...` and its indented source lines)."""
    lines = error_msg.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return lines[-1].strip() if lines else error_msg
    rest = lines[frames[-1] + 1 :]
    while rest and (rest[0].startswith("    ") or not rest[0].strip()):
        rest = rest[1:]  # the frame's source line and its ^^^ markers
    return "\n".join(rest).strip() or lines[-1].strip()


def _not_placed(names: list[str], config: ServeConfig, role: str) -> WorkersNotPlaced:
    where = (f"no node offers {ROLE_RESOURCES[role]}" if config.placement == "resources"
             else "no node has the resources they ask for")
    return WorkersNotPlaced(
        f"{', '.join(names)} not ready {config.start_timeout_s:g} s after serve began starting the cluster "
        f"(--start-timeout-s): either Ray has not placed them ({where} yet: `ray status` lists the pending "
        f"demands) or they are still loading their model")


def _wait_ready(slots: list[WorkerSlot], left_s: float, config: ServeConfig, role: str) -> list:
    import ray
    from ray.exceptions import RayActorError

    refs = [slot.handle.ready.remote() for slot in slots]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=left_s)
    if pending:
        raise _not_placed([slot.name for slot, ref in zip(slots, refs) if ref in pending], config, role)
    try:
        return ray.get(refs)
    except RayActorError as error:
        name = next((s.name for s in slots if error.actor_id and s.handle._actor_id.hex() == error.actor_id), "a worker")
        failure = _start_failure(error, f"{name} failed to start")
        if failure is None:
            raise
        raise failure from None


def _start_failure(error, what: str) -> WorkerStartFailed | None:
    """For a RayActorError whose actor's constructor raised, WorkerStartFailed with the worker's
    own exception after `what`; None for any other (the actor died later)."""
    if not getattr(error, "_actor_init_failed", False):
        return None
    return WorkerStartFailed(f"{what}: {_raised_in_worker(error.error_msg)}")


def _launch_store(name: str, fields: dict, left_s: float, config: ServeConfig, **options):
    """A store actor, or WorkerStartFailed with the store's own error (an arena larger than the
    node's memory, a port in use), not Ray's traceback around it."""
    from ray.exceptions import GetTimeoutError, RayActorError

    from ..kvstore import launch_store_actor

    try:
        return launch_store_actor(fields, timeout_s=left_s, **options)
    except GetTimeoutError:
        raise _not_placed([name], config, "store") from None
    except RayActorError as error:
        failure = _start_failure(error, f"{name} failed to start (capacity {fields['capacity_gb']:g} GB, port "
                                        f"{fields['port'] or 'any'})")
        if failure is None:
            raise
        raise failure from None


def _options(config: ServeConfig, role: str, **extra) -> dict:
    options = {"num_cpus": 0, **extra}
    if config.placement == "resources":
        options["resources"] = {ROLE_RESOURCES[role]: 1}
    # Ray hides every GPU from an actor that asks for none (CUDA_VISIBLE_DEVICES is emptied).
    if config.device == "cuda" and role in ("prefill", "decode"):
        options["num_gpus"] = config.gpus_per_worker
    return options


def _actor_class(cls):
    """A worker class as a Ray actor class with the health polls' own concurrency group."""
    import ray

    return ray.remote(concurrency_groups={HEALTH_GROUP: 1})(cls)


def check_gpus(config: ServeConfig, cluster_gpus: float) -> None:
    """Refuse at once a cluster this process started that cannot hold the GPU workers. A joined
    cluster is only warned about: its GPU nodes may still be joining (KubeRay starts pods in
    any order), and the actors then wait for them."""
    needed = config.gpus_needed
    if needed <= cluster_gpus + 1e-9:
        return
    message = (f"device='cuda' needs {needed:g} GPU(s) ({config.prefill_workers} prefill + {config.decode_workers} decode "
               f"worker(s) x gpus_per_worker {config.gpus_per_worker:g}) but the Ray cluster has {cluster_gpus:g}")
    if config.address:
        log.warning("%s now; waiting for GPU nodes to join", message)
        return
    raise NotEnoughGPUs(message + "; lower --gpus-per-worker or the worker counts, or use --device cpu")


def check_local_gpus(config: ServeConfig) -> None:
    """A cluster this process starts has this machine's GPUs: refuse before Ray starts."""
    if config.address or config.device != "cuda":
        return
    import torch

    check_gpus(config, float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0)


def check_cluster_answers(address: str | None, timeout_s: float = 10.0) -> None:
    """A Ray head at HOST:PORT must accept a connection and speak gRPC, as its GCS does: ray.init
    waits without end for one that does not answer, or that answers in another protocol (a
    dashboard's or any web server's port), logging a retry every 30 s. 'auto' and ray://
    addresses are Ray's."""
    import socket

    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ClusterUnreachable(f"--address must be 'auto' or HOST:PORT of a Ray head, got {address!r}")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 head, written as Ray writes it
        host = host[1:-1]
    try:
        connection = socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s)
    except OSError as error:
        raise ClusterUnreachable(f"no Ray cluster answers at {address} ({error}); start one with `ray start --head`, "
                                 "or leave --address out to start a local one") from None
    with connection:
        # Under TLS a handshake comes before HTTP/2: the connection is all that can be checked.
        if os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true") or _answers_http2(connection, timeout_s):
            return
    raise ClusterUnreachable(f"{address} answers, but not as a Ray head's GCS (gRPC) port; give the port `ray start "
                             "--head` printed (6379 by default), not the dashboard's or another server's")


def _answers_http2(connection, timeout_s: float) -> bool:
    """Whether the peer answers an HTTP/2 connection preface with a SETTINGS frame, as every
    gRPC server (Ray's GCS) does at once."""
    connection.settimeout(timeout_s)
    empty_settings = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # length 0, type SETTINGS, no flags, stream 0
    header = b""
    try:
        connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + empty_settings)
        while len(header) < 9:
            more = connection.recv(9 - len(header))
            if not more:
                break
            header += more
    except OSError:  # a timeout, or a peer that resets on these bytes: it answers, but not as gRPC
        return False
    return len(header) == 9 and header[3] == 4


def start_ray(config: ServeConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    if config.address:
        check_cluster_answers(config.address)
        try:
            ray.init(address=config.address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as error:
            # 'auto' with no cluster running, or ray:// without Ray's client installed: Ray's own
            # words, as a message rather than a traceback.
            raise ClusterUnreachable(f"cannot join the Ray cluster at --address {config.address}: "
                                     f"{' '.join(str(error).split()) or type(error).__name__}") from None
    else:
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(2, config.prefill_workers + config.decode_workers))


def store_config(config: ServeConfig, index: int) -> dict:
    """The StoreConfig fields of the cluster's `index`-th store."""
    fields = {"capacity_gb": config.store_capacity_gb, "port": config.store_port + index if config.store_port else 0,
              "transport": "tcp" if config.transport == "tcp" else "nixl", "ttl_s": config.store_ttl_s}
    if config.address:  # other nodes must reach it
        fields["host"] = "0.0.0.0"
    return fields


def launch(config: ServeConfig) -> ClusterHandles:
    """Start every actor and wait until each has loaded its model / opened its port, within
    `start_timeout_s` in all (the Helm chart's head startup probe is sized from it)."""
    import ray

    from ..decode_node.worker import DecodeWorker
    from ..prefill_node.worker import PrefillWorker

    deadline = time.monotonic() + config.start_timeout_s

    def left_s() -> float:
        return max(0.001, deadline - time.monotonic())

    start_ray(config)
    check_gpus(config, ray.cluster_resources().get("GPU", 0.0))
    threads = config.worker_threads()

    def role_resource(role: str) -> str | None:
        return ROLE_RESOURCES[role] if config.placement == "resources" else None

    stores = []
    for i in range(config.stores):
        # A dead store is restarted by Ray, empty, at an address the health poll picks up;
        # the requests it held fail. Without the restart a lost store pod was lost for good.
        handle, address = _launch_store(f"store-{i}", store_config(config, i), left_s(), config,
                                        **_options(config, "store", max_restarts=-1))
        stores.append(WorkerSlot(f"store-{i}", handle, capacity=int(config.store_capacity_gb * 2**30), address=address))
    if config.prefill_engine == "vllm":
        from ..prefill_node.vllm_worker import VLLMPrefillWorker

        prefill_cls = _actor_class(VLLMPrefillWorker)
        prefill_extra, prefill_options = (config.vllm_kv_cache_gb, config.vllm_max_model_len), {}
    else:
        prefill_cls = _actor_class(PrefillWorker)
        prefill_extra, prefill_options = (), {"prefix_cache_gb": config.prefix_cache_gb}
    decode_cls = _actor_class(DecodeWorker)
    prefill = [
        WorkerSlot(f"prefill-{i}", prefill_cls.options(**_options(config, "prefill", max_concurrency=8, max_restarts=-1)).remote(
            config.model, config.dtype, config.decode.block_size, config.prefill_chunk_tokens, threads, config.transport,
            *prefill_extra, summary_kind=config.summary_kind, device=config.device, role_resource=role_resource("prefill"),
            **prefill_options))
        for i in range(config.prefill_workers)
    ]
    decode = [
        # A dead worker is restarted by Ray (it reloads its model); requests in flight on it fail.
        WorkerSlot(f"decode-{i}", decode_cls.options(**_options(config, "decode", max_concurrency=1000, max_restarts=-1)).remote(
            config.model, config.decode.model_dump(), config.dtype, threads, config.transport,
            role_resource=role_resource("decode")),
            seats=config.decode.max_num_seqs)
        for i in range(config.decode_workers)
    ]
    _wait_ready(prefill, left_s(), config, "prefill")
    for slot, info in zip(decode, _wait_ready(decode, left_s(), config, "decode")):
        slot.capacity = info["pool_rows"]
    log.info("cluster up: %d prefill, %d decode, %d store(s)", len(prefill), len(decode), len(stores))
    return ClusterHandles(prefill, decode, stores)


def shutdown(handles: ClusterHandles | None) -> None:
    import ray

    if handles is not None:
        # Decode workers first: they free their requests in the stores before the stores stop.
        for slot, timeout_s in [(decode, 30) for decode in handles.decode] + [(store, 10) for store in handles.stores]:
            try:
                ray.get(slot.handle.shutdown.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                log.warning("%s did not shut down within %d s; going on without it", slot.name, timeout_s)
            except Exception:  # a dead worker has nothing left to free
                pass
    if ray.is_initialized():
        ray.shutdown()
