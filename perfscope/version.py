"""perfscope's version: a module of its own, so that what records it (the collectors' run metadata)
imports it without the package's __init__ and its imports."""

__version__ = "0.1.0"
