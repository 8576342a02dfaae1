"""The package version, where Slapo kept it (``slapo.version.__version__``)."""

from . import __version__

__all__ = ["__version__"]
