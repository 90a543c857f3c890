"""A comparison rendered: the ranked table (ranking.py, terminal.py), report.md (report.py, effects_section.py),
the plots (plots.py, figures.py, stability_plot.py, scale_plot.py), CSV and JSON exports (exports.py), a wandb
workspace (workspace.py), and a run's own layer x step heatmaps (heatmap.py)."""
