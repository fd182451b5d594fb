"""`python -m mlx_flash.convert`: see mlx_flash/convert/build.py."""

from .build import main

main()
