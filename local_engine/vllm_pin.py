"""Whether the installed vLLM is within the range flowlift's ``cuda`` extra pins.

The range (``pyproject.toml``: ``cuda = ["vllm>=0.33,<0.35"]``) is what was checked by
reading vLLM's source (docs/gpu.md says which versions and how; nothing has run on a
GPU). The GPU image (Dockerfile.gpu) runs ``python3 -m flowlift.local_engine.vllm_pin``
so a build on a base image outside the range fails instead of shipping an untested pair.

Reads installed metadata only (``importlib.metadata``); imports neither vLLM nor torch.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet


def pinned_range(requires: Sequence[str] | None = None) -> SpecifierSet:
    """The ``vllm`` specifier of flowlift's ``cuda`` extra.

    Args:
        requires: flowlift's requirement strings (default: the installed metadata's).

    Raises:
        LookupError: the metadata names no ``vllm`` for the ``cuda`` extra.
    """
    for line in requires if requires is not None else (
            importlib.metadata.requires("flowlift") or ()):
        req = Requirement(line)
        extra = req.marker or Marker('extra == ""')
        if req.name == "vllm" and extra.evaluate({"extra": "cuda"}):
            return req.specifier
    raise LookupError("flowlift's metadata pins no vllm for the cuda extra")


def outside(version: str, spec: SpecifierSet) -> str | None:
    """A message when ``version`` is outside ``spec``, else None."""
    if spec.contains(version, prereleases=True):
        return None
    return (f"vLLM {version} is outside the range flowlift was checked against "
            f"(vllm{spec}); see docs/gpu.md")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flowlift.local_engine.vllm_pin``: exit 1 (with the reason) when the
    installed vLLM is outside the pin or missing, 0 otherwise."""
    del argv
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        print("vllm is not installed", file=sys.stderr)
        return 1
    spec = pinned_range()
    problem = outside(version, spec)
    print(problem or f"vLLM {version} is within flowlift's checked range vllm{spec}",
          file=sys.stderr if problem else sys.stdout)
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
