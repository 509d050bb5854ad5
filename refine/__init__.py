"""refine: prove that a distributed model implementation refines its sequential model."""

__version__ = "0.1.0"
