"""What the load test sends: random prompts of given lengths, long prompts made from real files
(the Python standard library's sources by default), or prompts from a JSONL file.

Lengths are in tokens. Without a tokenizer they are estimates (a random prompt's words are
common English words, about one token each; file text is counted at ~4 characters a token); the
report prefers the token counts the server returns in `usage`. With `--tokenizer` (a
tokenizer.json, or a directory holding one) lengths are exact.
"""

from __future__ import annotations

import codecs

import json
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHARS_PER_TOKEN = 4

# Common short words: nearly every one is a single token (with its leading space) in BPE
# vocabularies, so a prompt of N words is close to N tokens without a tokenizer.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "can more other its time some into two then them these may first any new now such like our "
    "over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right "
    "used take three house small place set end put home read hand large add spell land light"
).split()

FILE_QUESTIONS = (
    "Summarize what this code does and how its parts fit together.",
    "List the public functions and classes above, with one line on what each does.",
    "Point out one likely bug or edge case in the code above and explain it.",
    "Explain how a caller would use the main entry point of this code.",
)


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int   # tokens (estimated unless a tokenizer was given)
    max_tokens: int


class TokenCounter:
    """Counts tokens with a real tokenizer when given one, otherwise estimates."""

    def __init__(self, tokenizer_path: str | None = None):
        self._tokenizer = None
        if tokenizer_path:
            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            file = path / "tokenizer.json" if path.is_dir() else path
            try:
                self._tokenizer = Tokenizer.from_file(str(file))
            except Exception as exc:  # the tokenizers library raises a bare Exception for every failure
                raise ValueError(f"--tokenizer {tokenizer_path!r}: {file} is not a readable tokenizer.json ({exc})") \
                    from exc

    @property
    def exact(self) -> bool:
        return self._tokenizer is not None

    def count(self, text: str, words: bool = False) -> int:
        if self._tokenizer is not None:
            return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return len(text.split()) if words else max(1, round(len(text) / CHARS_PER_TOKEN))

    def truncate(self, text: str, tokens: int) -> str:
        """The longest prefix of `text` with at most `tokens` tokens (estimated: characters)."""
        if self._tokenizer is None:
            return text[: tokens * CHARS_PER_TOKEN]
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        if len(encoding.ids) <= tokens:
            return text
        return text[: encoding.offsets[tokens - 1][1]] if tokens > 0 else ""


def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lengths drawn uniformly from [mean * (1 - r), mean * (1 + r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), not {range_ratio:g}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator, counter: TokenCounter) -> list[BenchRequest]:
    inputs = sample_lengths(input_len, range_ratio, n, rng)
    outputs = sample_lengths(output_len, range_ratio, n, rng)
    requests = []
    for length, max_tokens in zip(inputs, outputs):
        # twice the words when a tokenizer will cut the prompt to size exactly
        words = rng.choice(WORDS, size=int(length) * (2 if counter.exact else 1))
        prompt = " ".join(words)
        if counter.exact:
            prompt = counter.truncate(prompt, int(length))
        requests.append(BenchRequest(prompt, counter.count(prompt, words=True), int(max_tokens)))
    return requests


def default_files_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def file_requests(n: int, input_len: int, output_len: int, rng: np.random.Generator,
                  counter: TokenCounter, directory: Path | None = None,
                  pattern: str = "*.py") -> list[BenchRequest]:
    """Prompts of about `input_len` tokens of real source: consecutive files (in a seeded order),
    each under a `# file:` header, cut to length, followed by a question about them."""
    directory = Path(directory) if directory else default_files_dir()
    root, relative = directory, pattern
    if Path(pattern).is_absolute():
        # An absolute pattern names its own folder, as a path joined to it would; Path.glob
        # refuses one, so it is matched from the root it starts at.
        root = Path(Path(pattern).anchor)
        relative = str(Path(pattern).relative_to(root))
    if not Path(relative).parts:  # "", ".", "/": Path.glob fails on these with an IndexError
        raise ValueError(f"file pattern {pattern!r} names no files")
    files = sorted(p for p in root.glob(relative) if p.is_file())
    if not files:
        raise ValueError(f"no files match {pattern!r}" + ("" if Path(pattern).is_absolute() else f" in {directory}"))
    order = [files[i] for i in rng.permutation(len(files))]
    requests, cursor = [], 0
    for i in range(n):
        question = FILE_QUESTIONS[i % len(FILE_QUESTIONS)]
        budget = max(1, input_len - counter.count(question) - 8)
        parts: list[str] = []
        for _ in range(len(order)):  # bounded: at most every file once per prompt
            text = order[cursor % len(order)].read_text(errors="replace")
            parts.append(f"# file: {order[cursor % len(order)].name}\n{text}")
            cursor += 1
            if counter.count("\n".join(parts)) >= budget:
                break
        body = counter.truncate("\n".join(parts), budget)
        prompt = f"```python\n{body}\n```\n\n{question}"
        requests.append(BenchRequest(prompt, counter.count(prompt), output_len))
    return requests


def jsonl_requests(path: Path, n: int, default_output_len: int,
                   counter: TokenCounter) -> list[BenchRequest]:
    """One JSON object a line: {"prompt": "...", "max_tokens": 128} (max_tokens optional).
    Lines are used in order, repeated when `n` is larger than the file."""
    prompts = []
    # Lines end at "\n" (JSON Lines), not wherever str.splitlines ends one: a JSON string may hold
    # a raw U+2028 or form feed. Each line is decoded alone, so bad bytes are named by line.
    for number, raw in enumerate(Path(path).read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x}, byte "
                             f"{exc.start + 1} of the line); JSONL files are UTF-8") from None
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f'{path}:{number}: needs a non-empty string "prompt"')
        max_tokens = item.get("max_tokens", default_output_len)
        # bool is an int in Python: true would have asked for 1 token
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"{path}:{number}: max_tokens must be a positive integer, not {json.dumps(max_tokens)}")
        prompts.append(BenchRequest(item["prompt"], counter.count(item["prompt"]), max_tokens))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


def build_requests(args, rng: np.random.Generator, counter: TokenCounter | None = None) -> list[BenchRequest]:
    counter = counter if counter is not None else TokenCounter(args.tokenizer)
    makers: dict[str, Callable[[], list[BenchRequest]]] = {
        "random": lambda: random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                          args.random_range_ratio, rng, counter),
        "files": lambda: file_requests(args.num_prompts, args.files_input_len, args.files_output_len,
                                       rng, counter, args.files_dir, args.files_glob),
        "jsonl": lambda: jsonl_requests(args.jsonl_path, args.num_prompts, args.jsonl_output_len, counter),
    }
    return makers[args.dataset]()
