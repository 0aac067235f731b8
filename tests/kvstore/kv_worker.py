"""A separate process that writes or reads one request (used by test_multiprocess).

    python -m tests.kvstore.kv_worker write ADDRESS TRANSPORT SEED REQUEST_ID TOKENS
    python -m tests.kvstore.kv_worker read  ADDRESS TRANSPORT SEED REQUEST_ID TOKENS [--free]

The data is regenerated from the seed, so the reader checks bit-exactness without being sent
the expected bytes. Prints one JSON line; exit status 0 only if every byte matched.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from oasiskv.kvstore import connect, summarize_request

from .helpers import LAYOUT, random_request_kv, random_request_blocks


def main(argv: list[str]) -> int:
    action, address, transport, seed, request_id, tokens = argv[:6]
    seed, tokens = int(seed), int(tokens)
    with connect(address, transport=transport, timeout=20) as client:
        if action == "write":
            client.allocate(request_id, LAYOUT, tokens)
            src = random_request_blocks(seed, LAYOUT, tokens)
            # Layer by layer from one registered buffer, as a prefill node would.
            client.register(src)
            handles = [client.write_blocks(request_id, layer, np.tile(np.arange(LAYOUT.num_kv_heads), src.shape[1]),
                                           np.repeat(np.arange(src.shape[1]), LAYOUT.num_kv_heads), src,
                                           layer * src.shape[1] * LAYOUT.num_kv_heads + np.arange(src.shape[1] * LAYOUT.num_kv_heads))
                       for layer in range(LAYOUT.num_layers)]
            for handle in handles:
                handle.wait()
            print(json.dumps({"ok": True, "units": int(sum(h.num_units for h in handles))}))
            return 0
        keys, _ = random_request_kv(seed, LAYOUT, tokens)
        src = random_request_blocks(seed, LAYOUT, tokens)
        info = client.describe(request_id)
        # Every unit once, in a random order, into random slots, in batches of 97.
        rng = np.random.default_rng(seed + 1)
        units = np.indices((LAYOUT.num_layers, LAYOUT.num_kv_heads, info.num_blocks)).reshape(3, -1)
        order = rng.permutation(units.shape[1])
        pool = torch.zeros(units.shape[1], *LAYOUT.unit_shape, dtype=LAYOUT.dtype)
        slots = rng.permutation(units.shape[1])
        client.register(pool)
        handles = []
        for batch in np.array_split(order, max(1, len(order) // 97)):
            handles.append(client.read_blocks(request_id, *units[:, batch], pool, slots[batch]))
        for handle in handles:
            handle.wait()
        layers, heads, blocks = units[:, order]
        exact = torch.equal(pool[slots[order]], src[layers, blocks, heads])
        summaries_exact = torch.equal(client.read_summaries(request_id), summarize_request(keys, LAYOUT.block_size))
        if "--free" in argv:
            client.free(request_id)
        print(json.dumps({"ok": bool(exact and summaries_exact), "units": int(order.size),
                          "exact": bool(exact), "summaries_exact": bool(summaries_exact)}))
        return 0 if exact and summaries_exact else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
