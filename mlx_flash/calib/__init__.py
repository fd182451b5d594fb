"""Calibration and sparse evaluation: the selectors a flash directory ships (calibrate), their quality on
held-out text (quality), neuron order on flash (reorder), and recorded active sets (trace).

Built on the core; nothing in the core imports it."""
