"""Scaling laws: the points table runs give (N, D, C, loss), the published fitting methods, and what
they predict for a compute budget."""

from lmlab.scaling.laws import (ComputeOptimal, FrontierFit, JointLaw, KaplanFit, PowerLaw, bootstrap, fit_envelope,
                                fit_isoflop, fit_joint, fit_kaplan, fit_power_law)
from lmlab.scaling.points import Point, read_points, write_points

__all__ = ["ComputeOptimal", "FrontierFit", "JointLaw", "KaplanFit", "Point", "PowerLaw", "bootstrap", "fit_envelope",
           "fit_isoflop", "fit_joint", "fit_kaplan", "fit_power_law", "read_points", "write_points"]
