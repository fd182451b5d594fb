"""Calibration and sparse evaluation, the parts `python -m mlx_flash.calibrate` is made of: DIP's densities (dip),
trained predictors (predictors), the choice of the selector a directory ships (selector), their quality on held-out
text (quality), neuron order on flash (reorder), and recorded active sets (trace).

Built on the core; nothing in the core imports it."""
