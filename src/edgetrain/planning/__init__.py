"""edgetrain.planning."""
