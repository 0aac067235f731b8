"""`oasiskv generate`: run the local engine on one or more prompts and print the completions."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registry name, HF directory or .gguf file")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set of tokens of this mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among this many most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling repeatable (default: unseeded)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and KV (auto: bfloat16 on cuda, else float32)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")


def run_generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ..config_errors import describe, name_flags
    from .engine import LLM
    from .errors import ModelError
    from .sampling import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except (ValueError, ValidationError, ModelError) as error:
        shown = describe(error, args) if isinstance(error, ValidationError) else name_flags(str(error), args)
        print(f"error: {shown}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))
        else:
            print(out.text)
    return 0
