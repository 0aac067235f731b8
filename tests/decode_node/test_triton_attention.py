"""The Triton sparse attention kernel against the torch path it replaces.

The reference gathers the units by hand and runs the real `position_mask` and `attend_gathered`:
the decode node's torch path (`gathered_attention`), written out independently. On CPUs the
kernel runs under Triton's interpreter (in a child process, see `interpreted`); the `cuda` test
compiles it for a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from oasiskv.decode_node.triton_attention import sparse_paged_attention, triton_available
from oasiskv.models.attention import PAD_POSITION, attend_gathered, position_mask

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@dataclass(frozen=True)
class Case:
    seqs: int
    kv_heads: int
    group: int
    rows: int  # Tq
    units: int  # R
    window: int | None = None
    blind_row: bool = False  # one query row may see no key at all
    block_size: int = 16
    head_dim: int = 64
    seed: int = 0


CASES = [
    Case(seqs=1, kv_heads=1, group=1, rows=1, units=1),
    Case(seqs=2, kv_heads=2, group=7, rows=1, units=5, seed=1),  # Qwen2.5-0.5B: 14 heads over 2
    Case(seqs=3, kv_heads=1, group=3, rows=4, units=9, seed=2),
    Case(seqs=2, kv_heads=2, group=7, rows=4, units=3, window=24, seed=3),
    Case(seqs=2, kv_heads=2, group=3, rows=4, units=6, blind_row=True, seed=4),
    Case(seqs=1, kv_heads=2, group=2, rows=4, units=4, window=5, blind_row=True, seed=5),
    # Tile padding: block_size and head_dim that are not powers of two.
    Case(seqs=2, kv_heads=1, group=3, rows=1, units=3, block_size=12, head_dim=48, seed=6),
]


def make_inputs(case: Case, pool_dtype=torch.float32, query_dtype=torch.float32):
    """Working sets as the decode node builds them: each (sequence, KV head) holds R distinct
    logical blocks in shuffled unit order, some units empty (all slots PAD, pointing at a shared
    unit like the padding rows do), the newest block holding keys after the query rows."""
    g = torch.Generator().manual_seed(case.seed)
    bs, d = case.block_size, case.head_dim
    num_units = case.seqs * case.kv_heads * case.units + 2
    pool = torch.randn(num_units, 2, bs, d, generator=g).to(pool_dtype)
    unit_ids = torch.randperm(num_units, generator=g)[: case.seqs * case.kv_heads * case.units]
    unit_ids = unit_ids.view(case.seqs, case.kv_heads, case.units).clone()

    logical_blocks = case.units + 3
    query_positions = torch.zeros(case.seqs, case.rows, dtype=torch.long)
    key_positions = torch.full((case.seqs, case.kv_heads, case.units * bs), PAD_POSITION, dtype=torch.long)
    for s in range(case.seqs):
        real_rows = case.rows if s == 0 else int(torch.randint(1, case.rows + 1, (1,), generator=g))
        while True:
            context = int(torch.randint(real_rows, logical_blocks * bs, (1,), generator=g))
            rows = torch.arange(context - real_rows, context)
            # Every row sees a key: the sink block 0 (padding rows sit at 0) and the rows' own blocks.
            needed = {0} | set((rows // bs).tolist())
            if len(needed) <= case.units:
                break
        query_positions[s, :real_rows] = rows  # padding rows stay at 0
        for h in range(case.kv_heads):
            others = [b for b in torch.randperm(logical_blocks, generator=g).tolist() if b not in needed]
            blocks = torch.tensor(sorted(needed) + others[: case.units - len(needed)])
            blocks = blocks[torch.randperm(case.units, generator=g)]
            for u, block in enumerate(blocks.tolist()):
                if block not in needed and float(torch.rand((), generator=g)) < 0.3:
                    unit_ids[s, h, u] = num_units - 1  # an empty unit: any id, all PAD
                    continue
                key_positions[s, h, u * bs : (u + 1) * bs] = block * bs + torch.arange(bs)
    if case.blind_row:
        # The last row of sequence 0 sits at position 0 (as a padding row does) and no key of
        # sequence 0 is at 0, so that row may see nothing and falls back to key 0.
        query_positions[0, -1] = 0
        key_positions[0][key_positions[0] == 0] = PAD_POSITION

    scale = d**-0.5
    # Built as [B, Tq, heads, d] and viewed as [B, heads, Tq, d], as batch_queries does: strided.
    queries = torch.randn(case.seqs, case.rows, case.kv_heads * case.group, d, generator=g)
    queries = queries.to(query_dtype).transpose(1, 2)
    return queries, pool, unit_ids, key_positions, query_positions, case.window, scale


def torch_reference(queries, pool, unit_ids, key_positions, query_positions, window, scale):
    seqs, kv_heads, units = unit_ids.shape
    gathered = pool[unit_ids]  # [B, kv_heads, R, 2, bs, d]
    keys = gathered[:, :, :, 0].reshape(seqs, kv_heads, -1, pool.shape[-1])
    values = gathered[:, :, :, 1].reshape(seqs, kv_heads, -1, pool.shape[-1])
    mask = position_mask(query_positions, key_positions, window)
    return attend_gathered(queries, keys, values, mask, scale).float()


def has_blind_row(key_positions, query_positions, window) -> bool:
    q = query_positions[:, None, :, None]
    k = key_positions[:, :, None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return bool((~allowed.any(-1)).any())


def to(inputs, device):
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)


def case_id(c: Case) -> str:
    window = f"-w{c.window}" if c.window else ""
    blind = "-blind" if c.blind_row else ""
    return f"B{c.seqs}-kv{c.kv_heads}-g{c.group}-q{c.rows}-R{c.units}{window}{blind}-bs{c.block_size}-d{c.head_dim}"


BF16_CASE = Case(seqs=2, kv_heads=2, group=7, rows=4, units=5, window=40, blind_row=True, seed=7)


def comparisons():
    """name -> (inputs, tolerance) for every kernel-vs-torch comparison."""
    found = {case_id(c): (make_inputs(c), 1e-4) for c in CASES}
    # fp32 queries: both sides widen the bf16 pool exactly and compute in fp32; only the order
    # of summation differs. bf16 queries: the kernel still computes in fp32, the torch path in
    # SDPA's bf16 (fp32 scores and softmax, probabilities and output rounded to bf16, 2^-8).
    for query_dtype, tolerance in ((torch.float32, 2e-3), (torch.bfloat16, 1.5e-2)):
        inputs = make_inputs(BF16_CASE, pool_dtype=torch.bfloat16, query_dtype=query_dtype)
        found[f"bf16-pool-{str(query_dtype).removeprefix('torch.')}-queries"] = (inputs, tolerance)
    # Units split across programs (what a GPU does by default): one unit a split, a split that
    # ends mid-tile, and a blind row whose splits all see nothing.
    for case, per_split in ((CASES[2], 1), (CASES[1], 3), (CASES[4], 2), (CASES[5], 1)):
        queries, pool, unit_ids, key_positions, query_positions, window, scale = make_inputs(case)
        found[f"{case_id(case)}-split{per_split}"] = (
            (queries, pool, unit_ids, key_positions, query_positions, window, scale, per_split), 1e-4)
    queries, pool, _, _, query_positions, _, scale = make_inputs(CASES[0])
    no_units = torch.zeros(1, 1, 0, dtype=torch.long)
    found["no-units"] = ((queries, pool, no_units, no_units, query_positions, None, scale), 1e-4)
    return found


def compare_all(device: str = "cpu") -> dict[str, str]:
    """name -> "ok" or what differed, for every comparison."""
    results = {}
    for name, (inputs, tolerance) in comparisons().items():
        inputs = to(inputs, device)
        try:
            got = sparse_paged_attention(*inputs)
            want = torch_reference(*inputs[:7])
            assert got.dtype == torch.float32, got.dtype
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
            results[name] = "ok"
        except Exception as error:  # reported per comparison by the parent's tests
            results[name] = f"{type(error).__name__}: {error}"
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every comparison, run by Triton's interpreter in a child process.

    Not in this process: Triton picks compile-or-interpret once, when it is first imported (its
    own tl.sum, tl.max... are jitted then), and interpreting leaves triton.language patched. Any
    earlier import of triton here (torch, another test) would make an in-process interpreter fail,
    and the interpreter would break the GPU-compile test below."""
    script = (
        "import json, tests.decode_node.test_triton_attention as t\n"
        "print(json.dumps(t.compare_all()))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cases_exercise_what_they_claim(case):
    _, _, _, key_positions, query_positions, window, _ = make_inputs(case)
    assert has_blind_row(key_positions, query_positions, window) == case.blind_row


@needs_triton
@pytest.mark.parametrize("name", list(comparisons()))
def test_interpreter_matches_torch_path(interpreted, name):
    assert interpreted[name] == "ok", interpreted[name]


def _bad(mutate):
    def build():
        args = list(make_inputs(Case(seqs=2, kv_heads=2, group=2, rows=1, units=2)))
        mutate(args)
        return args

    return build


BAD_INPUTS = {
    "heads not a multiple of kv_heads": _bad(lambda a: a.__setitem__(0, a[0][:, :3])),
    "float unit ids": _bad(lambda a: a.__setitem__(2, a[2].float())),
    "bool unit ids": _bad(lambda a: a.__setitem__(2, a[2] > 0)),
    "float positions": _bad(lambda a: a.__setitem__(4, a[4].float())),
    "head_dim mismatch": _bad(lambda a: a.__setitem__(1, a[1][..., :32])),
    "not a K/V pair": _bad(lambda a: a.__setitem__(1, a[1][:, :1])),
    "key_positions too short": _bad(lambda a: a.__setitem__(3, a[3][..., :-1])),
    "unit_ids for another batch": _bad(lambda a: a.__setitem__(2, a[2][:1])),
    "query_positions rows mismatch": _bad(lambda a: a.__setitem__(4, a[4].repeat(1, 2))),
    "queries missing a dimension": _bad(lambda a: a.__setitem__(0, a[0][:, :, 0])),
    "window not an int": _bad(lambda a: a.__setitem__(5, 4.0)),
    "different devices": _bad(lambda a: a.__setitem__(2, a[2].to("meta"))),
    "units_per_split zero": _bad(lambda a: a.append(0)),
    "units_per_split not an int": _bad(lambda a: a.append(2.0)),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise_value_error(name):
    with pytest.raises(ValueError):
        sparse_paged_attention(*BAD_INPUTS[name]())


def test_units_are_split_so_every_sm_has_programs(monkeypatch):
    from oasiskv.decode_node import triton_attention

    monkeypatch.setattr(triton_attention, "_multiprocessors", lambda device: 132)  # an H100 / H200
    cuda = torch.device("cuda")
    # 4 sequences x 2 KV heads at 32K (2,032 units, 4 a tile): 66 splits of 8 tiles, 528 programs.
    assert triton_attention._units_per_split(2032, 8, 4, cuda) == 32
    # A 2,048-token working set of one sequence: one tile a program, every tile its own split.
    assert triton_attention._units_per_split(134, 2, 4, cuda) == 4
    # Many pairs already fill the GPU: a pair keeps all its units.
    assert triton_attention._units_per_split(134, 1024, 4, cuda) == 136
    # The interpreter runs programs one by one: no splitting.
    assert triton_attention._units_per_split(2032, 8, 4, torch.device("cpu")) == 2032


def test_triton_available(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_available("cpu")
    installed = importlib.util.find_spec("triton") is not None
    assert triton_available("cuda") == (installed and torch.cuda.is_available())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available(torch.device("cpu")) == installed


def test_cpu_without_interpreter_refuses(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read per call, unlike triton's own mode
    with pytest.raises(RuntimeError, match="CUDA"):
        sparse_paged_attention(*make_inputs(CASES[0]))


def test_imports_without_triton():
    """CPU-only installs have no Triton: the module must import and say it is unavailable."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "from oasiskv.decode_node.triton_attention import triton_available\n"
        "assert not triton_available('cuda')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@needs_triton
def test_compiles_for_a_gpu_target():
    """The interpreter accepts some programs the compiler rejects; compiling for sm_90 needs no GPU
    (Triton ships ptxas), so CPU-only CI also checks the real code path builds."""
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from oasiskv.decode_node import triton_attention

    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        pytest.skip("TRITON_INTERPRET is set: this process's Triton interprets and cannot compile")
    kernel = triton_attention._kernel()
    constexprs = dict(GROUP=7, HAS_WINDOW=True, BLOCK_ROWS=32, BLOCK_KEYS=16, UNITS_PER_TILE=4, BLOCK_DIM=64)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("queries_ptr", "max_ptr", "sum_ptr", "acc_ptr"):
            signature[name] = "*fp32"
        elif name == "pool_ptr":
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):  # unit ids and positions
            signature[name] = "*i64"
        else:
            signature[name] = "fp32" if name == "scale" else "i64" if "stride" in name else "i32"
    source = compiler.ASTSource(
        fn=kernel, signature=signature,
        constexprs={(kernel.arg_names.index(name),): value for name, value in constexprs.items()},
    )
    compiled = compiler.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in compiled.asm


@pytest.mark.cuda
@needs_triton
def test_matches_torch_path_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        pytest.skip("TRITON_INTERPRET is set: this test compiles for the GPU")
    results = compare_all("cuda")
    # A decode-sized case too: a Llama-8B-like group, a long working set, head_dim 128.
    big = Case(seqs=4, kv_heads=8, group=4, rows=8, units=64, window=256, head_dim=128, seed=9)
    for pool_dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-3)):
        inputs = to(make_inputs(big, pool_dtype=pool_dtype), "cuda")
        try:
            torch.testing.assert_close(sparse_paged_attention(*inputs), torch_reference(*inputs),
                                       atol=tolerance, rtol=tolerance)
            results[f"big-{pool_dtype}"] = "ok"
        except AssertionError as error:
            results[f"big-{pool_dtype}"] = str(error)
    failed = {name: result for name, result in results.items() if result != "ok"}
    assert not failed, failed
