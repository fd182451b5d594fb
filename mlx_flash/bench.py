"""`python -m mlx_flash.bench`: the command; its code is mlx_flash/tools/bench.py."""

from .tools.bench import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
