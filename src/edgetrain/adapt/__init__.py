"""Deprecated: the opt-in approximations moved to :mod:`edgetrain.approx` (this alias goes next release)."""

from __future__ import annotations

import warnings

from ..approx import *  # noqa: F401,F403
from ..approx import __all__ as _approx_all
from ..approx.elastic import ElasticSelector  # noqa: F401
from ..approx.gradfilter import LayerCost  # noqa: F401
from ..approx.gradfilter.core import FilteredConv2d, filtered_conv2d  # noqa: F401

__all__ = [*_approx_all, "ElasticSelector", "FilteredConv2d", "LayerCost", "filtered_conv2d"]

warnings.warn("edgetrain.adapt is deprecated: import from edgetrain.approx (or edgetrain.approx.elastic / "
              "edgetrain.approx.gradfilter)", DeprecationWarning, stacklevel=2)
