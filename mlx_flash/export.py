"""`python -m mlx_flash.export`: the command; its code is mlx_flash/convert/export.py."""

from .convert.export import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
