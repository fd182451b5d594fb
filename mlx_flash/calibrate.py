"""`python -m mlx_flash.calibrate`: the command; its code is mlx_flash/calib/calibrate.py."""

from .calib.calibrate import main, setup_arg_parser  # noqa: F401

if __name__ == "__main__":
    main()
