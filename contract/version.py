"""The release number, one place: pyproject reads it, ``vigil --version`` prints it, both services
export it as ``vigil_build_info`` and every agent report carries it. It decides nothing."""

__version__ = "0.1.0"
