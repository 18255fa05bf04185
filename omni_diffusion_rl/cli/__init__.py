"""`odrl`: the command line of omni-diffusion-rl, one module per command group (train, generate,
pretrain, serve, bench), their shared argument types (arguments) and the parser, errors and entry
point (main)."""

from .main import STARTUP_IMPORTS, build_parser, entry, main, parse_args

__all__ = ["STARTUP_IMPORTS", "build_parser", "entry", "main", "parse_args"]
