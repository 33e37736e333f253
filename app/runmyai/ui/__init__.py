"""Thin Qt widgets over the Qt-free services; signals at the seam."""
