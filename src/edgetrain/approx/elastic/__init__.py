"""edgetrain.approx.elastic."""
