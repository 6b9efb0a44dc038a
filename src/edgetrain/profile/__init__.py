"""edgetrain.profile."""
