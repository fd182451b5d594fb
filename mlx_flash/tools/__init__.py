"""Developer tools (`python -m mlx_flash.tools.<tool>`): a hard memory cap for a command (cap), the I/O engine
against fio (bench_io), the systems the peers command compares (peers_systems), one generation timed alike for every
system (steps), a model's routing regime (routing), estimates for other machines (simulate), synthetic models of
larger shapes (synthetic, synthetic_gguf) and the commands' plots (plot).

Built on the core, convert and calib; nothing below it imports it."""
