"""`python -m oasiskv.kvstore`: the same as `oasiskv kvstore`."""

import argparse
import sys

from .commands import add_arguments_kvstore, run_kvstore

parser = argparse.ArgumentParser(prog="python -m oasiskv.kvstore", description="run a standalone KV store server")
add_arguments_kvstore(parser)
sys.exit(run_kvstore(parser.parse_args()))
