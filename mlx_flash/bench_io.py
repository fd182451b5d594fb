"""`python -m mlx_flash.bench_io`: the command; its code is mlx_flash/tools/bench_io.py."""

from .tools.bench_io import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
