"""`python -m mlx_flash.trace`: the command; its code is mlx_flash/calib/trace.py."""

from .calib.trace import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
