"""The flash directory on disk: its files (directory.py), the manifest's schema (manifest.py), how units lie in it and
in a cache row (layout.py), ENDOR bitmap rows for pruned units (bitmap.py), safetensors written a tensor at a time
(safetensors_io.py), a config's shape (config.py) and the stored quantisations' arithmetic (quant.py).

Built on io and the base modules only."""
