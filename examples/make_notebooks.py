"""Writes the example notebooks from plain cell lists (so they are reviewable as code).

python examples/make_notebooks.py [NAME.ipynb ...]   # default: all
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

NOTEBOOKS = {
    "01_quickstart.ipynb": [
        new_markdown_cell(
            "# mlx_flash quick start\n\n"
            "Load the default model (SmolLM2-135M-Instruct, converted once into `~/.cache/mlx_flash`) and "
            "generate with mlx-lm's own `generate`. Everything FFN-related is read from flash."
        ),
        new_code_cell(
            "import mlx_flash  # first: on Linux it loads OpenBLAS before mlx.core\nfrom mlx_flash import generate"
        ),
        new_code_cell("model, tokenizer = mlx_flash.load()  # no budget: every neuron cached after first use"),
        new_code_cell(
            "messages = [{'role': 'user', 'content': 'Write one sentence about the sea.'}]\n"
            "prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)\n"
            "text = generate(model, tokenizer, prompt, max_tokens=40)\n"
            "print(text)\n"
            "assert len(text) > 0"
        ),
        new_code_cell("print(model.flash.stats.summary())\nmodel.flash.close()"),
    ],
    "02_memory_budget_and_stats.ipynb": [
        new_markdown_cell(
            "# Running in less memory than the model\n\n"
            "The budget covers resident weights, the KV cache, scratch buffers and the per-layer neuron "
            "caches. Below it, mlx_flash streams FFN neurons from flash for every token; below the "
            "resident weights themselves (about 75% of this model at this context), attention layers and the "
            "embedding / LM head are streamed too. Here we compare three budgets and read the per-token stats and "
            "what the planner decided."
        ),
        new_code_cell(
            "import mlx_flash\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
            "from mlx_flash import generate"
        ),
        new_code_cell(
            "results = {}\n"
            "for budget in ['25%', '75%', '100%']:\n"
            "    model, tokenizer = mlx_flash.load(memory_budget=budget, sparsity='dense', context=128)\n"
            "    generate(model, tokenizer, 'Once upon a time', max_tokens=16)\n"
            "    model.flash.stats.end()\n"
            "    results[budget] = model.flash.stats.summary()\n"
            "    print(budget, model.flash.plan.describe({k: v.stride for k, v in model.flash.fd.layouts.items()},\n"
            "                                          {k: r.n_units for k, r in model.flash.fd.layers[0].items()}))\n"
            "    model.flash.close()\n"
            "results"
        ),
        new_code_cell(
            "fig, ax = plt.subplots(figsize=(5, 3))\n"
            "bottom = [0] * len(results)\n"
            "for part in ['io_ms', 'mm_ms', 'compute_ms']:\n"
            "    vals = [results[b][part] for b in results]\n"
            "    ax.bar(list(results), vals, bottom=bottom, label=part)\n"
            "    bottom = [x + y for x, y in zip(bottom, vals)]\n"
            "ax.set_ylabel('ms / token (median)'); ax.set_xlabel('memory budget'); ax.legend()\n"
            "fig.savefig('budget_breakdown.png', dpi=100, bbox_inches='tight')\n"
            "assert results['25%']['bytes_per_token'] > results['75%']['bytes_per_token'] "
            "> results['100%']['bytes_per_token']\n"
            "assert results['25%']['streamed_bytes_per_token'] > 0 == results['75%']['streamed_bytes_per_token']"
        ),
    ],
    "03_calibrate_dip_density_vs_perplexity.ipynb": [
        new_markdown_cell(
            "# DIP: MLP density vs perplexity\n\n"
            "Dynamic Input Pruning keeps the largest |x| input columns of gate/up and the largest |GLU| rows of "
            "down. Calibration picks the split between the two for a target MLP density on the first half of "
            "WikiText-2; we then measure perplexity on held-out text from the second half, next to dense and the "
            "oracle (top-K of the true |GLU|, the headroom). DIP-CA prefers units an LFU cache already holds.\n\n"
            "Everything runs on a float32 resident copy with the active sets applied as masks "
            "(`mlx_flash.calib.quality`), so nothing is written to the model directory. This is a quick look: 256 "
            "held-out tokens, so the numbers are noisy. BENCHMARKS.md (Calibration) has the full table, with "
            "predictors and more tokens."
        ),
        new_code_cell(
            "import mlx_flash  # first: on Linux it loads OpenBLAS before mlx.core\n"
            "import matplotlib.pyplot as plt\n"
            "from mlx_flash import calibrate"
        ),
        new_code_cell(
            "# gamma 0.7: the DIP-CA strength that helps this model (0.2, the paper's, starves it; see BENCHMARKS.md)\n"
            "sweep = calibrate.density_sweep(densities=(0.75, 0.5, 0.3), seq_len=128, calib_seqs=2,\n"
            "                                eval_seqs=2, gamma=0.7)\n"
            "for d, split in sweep['dip'].items():\n"
            "    print(f\"DIP {d:.0%}: input density {split['input_density'][0]:.2f}, \"\n"
            "          f\"neuron density {split['neuron_density'][0]:.2f}\")\n"
            "print(calibrate.format_table(sweep))"
        ),
        new_code_cell(
            "rows = sweep['quality']['rows']\n"
            "dense = rows[0]['ppl']\n"
            "fig, ax = plt.subplots(figsize=(6, 4))\n"
            "for mode in ('oracle', 'dip', 'dip-ca'):\n"
            "    pts = sorted((r['mlp_density'], r['ppl']) for r in rows if r['mode'] == mode)\n"
            "    ax.plot(*zip(*pts), marker='o', label=mode)\n"
            "ax.plot([1.0], [dense], 'k*', markersize=10, label='dense')\n"
            "ax.set_xlabel('MLP density'); ax.set_ylabel('perplexity (held-out)'); ax.set_yscale('log'); ax.legend()\n"
            "ax.set_title('SmolLM2-135M, WikiText-2 (quick look)')\n"
            "plt.show()\n"
            "ppl = {(r['mode'], r['target_density']): r['ppl'] for r in rows}\n"
            "assert ppl['oracle', 0.75] < 1.1 * dense  # a quarter of the neurons cost almost nothing\n"
            "assert ppl['dip', 0.3] > ppl['dip', 0.75]  # fewer units, worse"
        ),
        new_markdown_cell(
            "To keep a calibration, run `python -m mlx_flash.calibrate --model DIR` on a copy of the directory "
            "(it records the DIP split and trained predictors in `DIR`, and can `--reorder` its neurons). On "
            "this 135M model DIP degrades fast below 75% while the oracle stays close to dense: the headroom a "
            "better selector could reach. The runtime serves DIP from a directory converted with `--layout dip`, "
            "and any sparsifier object (e.g. a `mlx_flash.engine.sparsity.Predictor` trained in memory) with "
            "`mlx_flash.load(sparsifier=...)`."
        ),
    ],
    "04_bench.ipynb": [
        new_markdown_cell(
            "# Where the time goes: the flash runtime benchmark\n\n"
            "`mlx_flash.bench` decodes the same prompt under each configuration of the paper's ablation, each "
            "with cold caches: **naive** (every FFN unit read per token), **hybrid** (dense, budget filled with "
            "cached units), **sparsity** (active units only, no cache), **window-unbundled** and **all** "
            "(sparsity + window cache, without and with bundling) and **mlx-lm** (all weights in DRAM).\n\n"
            "Quick mode on the default model at an 80% budget, where the resident weights still fit (below "
            "about 78% the planner streams attention layers or the LM head too: see BENCHMARKS.md). The "
            "uncalibrated default model uses an oracle stand-in sparsifier. 16 "
            "tokens per configuration on this machine's disk: a quick look; BENCHMARKS.md has the full runs."
        ),
        new_code_cell(
            "import mlx_flash  # first: on Linux it loads OpenBLAS before mlx.core\nfrom mlx_flash import bench"
        ),
        new_code_cell(
            "# the same as: python -m mlx_flash.bench --memory-budget 80% --quick --tokens 16 --no-fio\n"
            "res = bench.main(['--memory-budget', '80%', '--quick', '--tokens', '16', '--no-fio'])"
        ),
        new_code_cell(
            "fig = bench.figure(res)  # ms/token: I/O, memory management, compute, the sparsifier's selection\n"
            "c = res['configs']\n"
            "assert c['naive']['bytes_per_token'] == res['ffn_bytes']  # the whole FFN, every token\n"
            "assert c['all']['bytes_per_token'] < c['sparsity']['bytes_per_token'] < c['naive']['bytes_per_token']"
        ),
        new_markdown_cell(
            "Read the *flash->DRAM / token* column first: sparsity, the window cache and bundling cut the bytes "
            "read per token several-fold. On a model this small, on a 2-core CPU, compute dominates the "
            "latency, and the oracle stand-in pays for its own gate/up products (red); a calibrated predictor "
            "(`python -m mlx_flash.calibrate`) selects far more cheaply. `python -m mlx_flash.bench --synthetic "
            "llama-7b` runs the same ablation on a model much larger than the budget."
        ),
    ],
}


def main(names=()):
    for name, cells in NOTEBOOKS.items():
        if names and name not in names:
            continue
        for i, cell in enumerate(cells):
            cell.id = f"cell-{i}"  # stable ids: regenerating leaves unchanged notebooks unchanged
        meta = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
        nb = new_notebook(cells=cells, metadata=meta)
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
