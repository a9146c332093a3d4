"""The version of dynajax: its one source (pyproject.toml reads it, hatch's version
source; ``dynajax.__version__`` and the cache keys import it)."""

__version__ = "0.1.0"
