"""edgetrain.cli."""
