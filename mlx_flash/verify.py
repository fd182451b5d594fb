"""Check a flash directory: files, sizes, alignment, checksums (of the resident weights, each layer and each unit)
and that its tokenizer loads.

python -m mlx_flash.verify DIR
"""

import argparse
import sys

from tqdm import tqdm

from .errors import FlashFormatError
from .format.directory import FlashDir
from .loader import load_tokenizer


def setup_arg_parser():
    parser = argparse.ArgumentParser(description="Re-check a flash directory's sizes, alignment and checksums.")
    parser.add_argument("model", help="The flash directory to check.")
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        fd = FlashDir(args.model)
        fd.verify(progress=lambda layers: tqdm(layers, desc="verify", unit="layer"))
        load_tokenizer(fd)
    except FlashFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ok: {fd.path}: {len(fd.layers)} layers, {fd.ffn_bytes} bytes of bundles, checksums match, tokenizer loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
