"""`python -m mlx_flash.peers`: the command; its code is mlx_flash/tools/peers.py."""

from .tools.peers import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
