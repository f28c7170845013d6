"""Around the library: offline data, metrics, plots, calibration and rank studies, the CLI."""
