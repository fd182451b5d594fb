"""`python -m mlx_flash.cap`: the command; its code is mlx_flash/tools/cap.py."""

from .tools.cap import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
