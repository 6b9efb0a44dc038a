"""edgetrain.capture."""
