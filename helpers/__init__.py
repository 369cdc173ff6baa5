"""Repository helpers shared by environments (not part of the installed package)."""
