"""Writes the example notebooks from plain cell lists (so they are reviewable as code).

    python examples/make_notebooks.py
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
        new_code_cell("import mlx_flash  # first: on Linux it loads OpenBLAS before mlx.core\nfrom mlx_flash import generate"),
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
            "caches. Below it, mlx_flash streams FFN neurons from flash for every token. Here we compare "
            "two budgets and read the per-token stats."
        ),
        new_code_cell(
            "import mlx_flash\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
            "from mlx_flash import generate"
        ),
        new_code_cell(
            "results = {}\n"
            "for budget in ['65%', '100%']:\n"
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
            "bottom = [0, 0]\n"
            "for part in ['io_ms', 'mm_ms', 'compute_ms']:\n"
            "    vals = [results[b][part] for b in results]\n"
            "    ax.bar(list(results), vals, bottom=bottom, label=part)\n"
            "    bottom = [x + y for x, y in zip(bottom, vals)]\n"
            "ax.set_ylabel('ms / token (median)'); ax.set_xlabel('memory budget'); ax.legend()\n"
            "fig.savefig('budget_breakdown.png', dpi=100, bbox_inches='tight')\n"
            "assert results['65%']['bytes_per_token'] > results['100%']['bytes_per_token']"
        ),
    ],
}


def main():
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
