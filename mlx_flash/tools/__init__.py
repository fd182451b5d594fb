"""Measurement: the runtime's benchmark (bench), the I/O engine against fio (bench_io), other systems
under the same hard memory cap (peers, cap), estimates for other machines (simulate), and synthetic
models of larger shapes (synthetic, synthetic_gguf).

Built on the core, convert and calib; nothing below it imports it."""
