"""Package exports imported on first use, so importing one submodule does not import its siblings."""

from importlib import import_module


def lazy_exports(package: str, exports: dict[str, str]):
    """A module ``__getattr__`` resolving ``name`` from the module ``exports[name]`` (absolute, or relative to ``package``)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = exports[name]
        return getattr(import_module(module if "." in module else f"{package}.{module}"), name)

    return __getattr__
