"""The version of dynajax: its one source (pyproject.toml reads it, hatch's version
source; ``dynajax.__version__`` and the cache keys import it)."""

__version__ = "0.2.0.dev0"  # the next release, in development ([Unreleased] in CHANGELOG.md)
