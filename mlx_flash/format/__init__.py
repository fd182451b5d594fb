"""The flash directory on disk: its manifest, files and unit layouts (directory.py), ENDOR bitmap rows for pruned
units (bitmap.py) and safetensors written a tensor at a time (safetensors_io.py)."""
