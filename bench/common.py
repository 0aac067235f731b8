"""Helpers shared by the benchmarks: real input text and result files."""

from __future__ import annotations

import json
import statistics
import sysconfig
import time
from pathlib import Path

# Real code nobody here wrote, present on every machine: the Python standard library.
STDLIB_SOURCES = ("_pydecimal.py", "typing.py", "argparse.py", "inspect.py", "subprocess.py")


def stdlib_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / name).read_text() for name in STDLIB_SOURCES)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def real_text_token_ids(llm, num_tokens: int, offset: int = 0) -> list[int]:
    """`num_tokens` token ids of standard-library source, starting `offset` lines in."""
    lines = stdlib_text().splitlines(keepends=True)
    ids = llm.encode("".join(lines[offset * 37 :]))
    if len(ids) < num_tokens:
        raise ValueError(f"only {len(ids)} tokens of stdlib text available, {num_tokens} asked")
    return ids[:num_tokens]


def write_results(out_dir: Path, name: str, results: dict, plot=None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": name, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **results}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        plot(results, axes)
        fig.suptitle(name)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=110)
        plt.close(fig)
        print(f"wrote {out_dir / (name + '.png')}")
    return path
