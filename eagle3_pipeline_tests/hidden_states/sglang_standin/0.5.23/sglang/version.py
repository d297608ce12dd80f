"""The release the stand-in implements."""

__version__ = "0.5.23"
