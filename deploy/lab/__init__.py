"""A lab of hosts on one machine (network namespaces on a bridge, links shaped with `tc tbf`), to
run and measure weightsync across hosts without a cluster. `Lab` is the API; `python -m
deploy.lab` the CLI. See deploy/README.md, "Lab"."""

from deploy.lab.lab import Lab, remove
from deploy.lab.net import LabError, LabUnavailableError, missing_requirements

__all__ = ["Lab", "LabError", "LabUnavailableError", "missing_requirements", "remove"]
