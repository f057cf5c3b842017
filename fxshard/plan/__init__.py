"""Plan a deployment: predict memory and step time of a mesh from fxshard's own rank programs
(:func:`estimate`), search the meshes of a device count (:func:`plan`), price them with a
:class:`Hardware` model (datasheet presets or :func:`calibrate` of this machine)."""
from .calibrate import calibrate
from .estimate import Estimate, estimate
from .hardware import Hardware, Link, PRESETS
from .search import Plan, plan

__all__ = ["Estimate", "estimate", "Hardware", "Link", "PRESETS", "Plan", "plan", "calibrate"]
