"""The public API (the packages' ``__all__``) has docstrings and type hints on every public class, function and
method, as the developers' guide asks; attribute probes of ``ckpt_core`` behave like a normal module's."""
from __future__ import annotations

import importlib
import inspect

import pytest

PACKAGES = ("ckpt_core", "lightning_ckpt", "accelerate_ckpt")


def _public(pkg: str):
    module = importlib.import_module(pkg)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            yield f"{pkg}.{name}", obj
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not inspect.isfunction(member) or member.__module__ != obj.__module__:
                    continue
                yield f"{pkg}.{name}.{attr}", member
        elif inspect.isfunction(obj):
            yield f"{pkg}.{name}", obj


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_public_class_function_and_method_has_a_docstring_and_type_hints(pkg: str) -> None:
    undocumented, unhinted = [], []
    for where, obj in _public(pkg):
        if not (obj.__doc__ or "").strip():
            undocumented.append(where)
        if inspect.isfunction(obj):
            sig = inspect.signature(obj)
            params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
            if any(p.annotation is inspect.Parameter.empty for p in params) or (
                    sig.return_annotation is inspect.Signature.empty):
                unhinted.append(where)
    assert not undocumented, f"no docstring: {undocumented}"  # EmbeddingTracker.close, VerifyCache.blob, ...
    assert not unhinted, f"no type hints: {unhinted}"


def test_probing_ckpt_core_for_a_c_kernel_library_returns_false() -> None:
    """The C kernels (``_csig.*.so``) are ctypes libraries, not Python modules: ``hasattr`` raised the
    ImportError of importing one as a module (h163)."""
    import ckpt_core

    assert not hasattr(ckpt_core, "_csig") and not hasattr(ckpt_core, "no_such_name")
    for odd in ("cli.__main__", "_csig.x", ".", "..", ""):  # not names of submodules: no import is tried (h168)
        assert not hasattr(ckpt_core, odd), odd
    assert importlib.import_module("ckpt_core.format").__name__ == "ckpt_core.format"
    with pytest.raises(AttributeError):
        ckpt_core._cshuffle  # noqa: B018
