"""The one place the version is stamped (the build reads it, the app and engine report it)."""

__version__ = "0.1.0"
