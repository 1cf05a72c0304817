from kvtier.version import __version__ as __version__
