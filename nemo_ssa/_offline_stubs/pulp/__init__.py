"""Stub of PuLP for the offline GPU bundle (the real wheel is 16 MiB of CBC binaries).

Why it exists: nvidia-modelopt 0.37 imports ``pulp`` at module level
(``modelopt/torch/opt/searcher.py``), and ``nemo.collections.llm.{api,recipes}`` import
modelopt, so ``import pulp`` must succeed. PuLP itself is only *called* by modelopt's
linear-programming searcher (``LPS``, used by NAS / pruning / AutoQuantize searches),
which pretraining never runs.

What it does: any attribute (``pulp.LpVariable``, ``pulp.LpProblem``, ...) resolves to a
placeholder class, so module-level annotations such as ``list[pulp.LpVariable]``
evaluate; instantiating or calling any of them raises ImportError with a clear message.
"""

__version__ = "0+nemo_ssa.stub"
__nemo_ssa_stub__ = True

_MESSAGE = (
    "PuLP is not installed: this is nemo_ssa's import-only stub from the offline GPU "
    "bundle (docs/offline-bundle.md). modelopt's LP searcher needs the real package: "
    "install PuLP==3.3.2 and remove the nemo_ssa_offline_stubs wheel."
)


class _StubMeta(type):
    def __getitem__(cls, key):
        raise ImportError(_MESSAGE)

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(_MESSAGE)


class _Unavailable(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        raise ImportError(_MESSAGE)


_cache: dict = {}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in _cache:
        _cache[name] = _StubMeta(name, (_Unavailable,), {"__module__": __name__})
    return _cache[name]
