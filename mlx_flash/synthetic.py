"""`python -m mlx_flash.synthetic`: the command; its code is mlx_flash/tools/synthetic.py."""

from .tools.synthetic import main

if __name__ == "__main__":
    main()
