"""edgetrain.adaptation."""
