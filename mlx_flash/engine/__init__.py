"""The engine: per decode step and layer, which units a token needs, read from flash, computed.

A *unit* is what one selection picks and one read fetches: a neuron bundle of a dense FFN (the gate and up
columns and the down row of one hidden neuron, stored side by side) or an expert of a mixture-of-experts layer (its
gate, up and down matrices). Units live on flash in one file per layer region; a layer's units are read into its
DRAM cache (cache.py) by the native pread pool (../io/reader.py) and computed in place by a backend (../compute).

    units.py        the unit step, written once: plan against the cache, read the misses while the hits compute,
                    the overflow through a scratch buffer, partial results in a fixed order; the read-error guard
    neurons.py      neurons as units: a selector picks them (sparsity.py, selectors.py), their sum is the FFN
    experts.py      experts as units: the model's own router picks them, each computes the tokens that chose it
    read_ahead.py   the next layer's units read while a layer computes
    resident.py     attention layers and embeddings streamed too, below the resident floor; `Absent`, a module
                    another pipeline stage holds
    native_step.py  a decode step on the CPU's native kernels, layer by layer
    stats.py        per-token counters

Built on compute, format, io and the base modules. The models and the loader are above it: a function that needs
the model a config describes is given it by its caller.
"""
