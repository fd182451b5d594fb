"""`python -m mlx_flash.synthetic_gguf`: the command; its code is mlx_flash/tools/synthetic_gguf.py."""

from .tools.synthetic_gguf import main

if __name__ == "__main__":
    main()
