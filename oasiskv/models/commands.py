"""`oasiskv models list` and `oasiskv models pull NAME...`."""

from __future__ import annotations

import argparse
import sys

from .errors import ModelError, UnknownModelError


def add_arguments_models(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser("list", formatter_class=parser.formatter_class,
                                 help="show the registry models and whether they are pulled")
    listing.add_argument("--cache-dir", help="cache root (default $OASISKV_CACHE or ~/.cache/oasiskv)")
    pull = actions.add_parser("pull", formatter_class=parser.formatter_class,
                              help="download, verify and convert registry models")
    pull.add_argument("names", nargs="+", metavar="NAME", help="registry model name(s)")
    pull.add_argument("--cache-dir", help="cache root (default $OASISKV_CACHE or ~/.cache/oasiskv)")
    pull.add_argument("--force", action="store_true", help="discard the cached copy and pull again")


def run_models(args: argparse.Namespace) -> int:
    try:
        if args.models_action == "list":
            return _list(args.cache_dir)
        return _pull(args.names, args.cache_dir, args.force)
    except (ModelError, OSError) as exc:  # a message, not a traceback: these are the user's to fix
        print(f"error: {exc}", file=sys.stderr)
        # 2, as argparse and `oasiskv serve` exit on a bad argument; 1 for a pull that failed
        return 2 if isinstance(exc, UnknownModelError) else 1


def _list(cache_dir) -> int:
    # Only the registry and the cache layout: listing must not pay for importing torch.
    from .model_cache import CacheLayout, is_current
    from .registry import REGISTRY

    layout = CacheLayout.at(cache_dir)
    width = max(len(name) for name in REGISTRY)
    for name, spec in REGISTRY.items():
        target = layout.model_dir(name)
        state = f"pulled: {target}" if is_current(target) else "not pulled"
        print(f"{name:<{width}}  {spec.description}  [{state}]")
    return 0


def _pull(names: list[str], cache_dir, force: bool) -> int:
    from .pull import pull_model
    from .registry import get_spec

    for name in names:
        get_spec(name)  # fail on a typo before downloading anything
    for name in names:
        path = pull_model(name, cache_dir, progress=True, force=force)
        print(f"{name}: {path}")
    return 0
