"""edgetrain.approx.gradfilter."""
