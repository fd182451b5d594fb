"""`python -m mlx_flash.simulate`: the command; its code is mlx_flash/tools/simulate.py."""

from .tools.simulate import main

if __name__ == "__main__":
    main()
