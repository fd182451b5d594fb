"""`python -m mlx_flash.reorder`: the command; its code is mlx_flash/calib/reorder.py."""

from .calib.reorder import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
