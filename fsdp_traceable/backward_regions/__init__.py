"""Compiled autograd that compiles a repeated block's backward once (see
:mod:`.outline` for the rewrite, :mod:`.install` for where it hooks in)."""

from .install import install, supported
from .outline import outline

__all__ = ["install", "outline", "supported"]
