"""The proxy's settings: a flag given on the command line beats the config file's
``[server]`` section, which beats the defaults; a flag not given leaves the file's value."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowlift.cli import build_parser, serve_flags
from flowlift.errors import ConfigError
from flowlift.proxy import STATE, ProxyConfig, create_app
from flowlift.proxy.config import parse_config, settings
from flowlift.testing import FakeEngine

FILE = parse_config({"server": {"max_queue": 3}})


def _serve_settings(*argv: str) -> ProxyConfig:
    args = build_parser().parse_args(["serve", "--state-db", ":memory:", *argv])
    return settings(serve_flags(args), FILE)


def test_a_flag_beats_the_file():
    assert settings({"max_queue": 7}, FILE).max_queue == 7
    assert _serve_settings("--max-queue", "7").max_queue == 7


def test_the_file_beats_the_default():
    assert ProxyConfig().max_queue == 256
    assert settings({}, FILE).max_queue == 3
    assert settings({}, None).max_queue == 256


def test_a_flag_not_given_leaves_the_files_value_and_the_defaults():
    config = _serve_settings("--max-runs", "9")
    assert config.max_queue == 3 and config.max_runs == 9
    untouched = ProxyConfig()
    assert (config.max_sessions, config.session_ttl_s, config.max_body_bytes,
            config.scheduling, config.batch_prefill_budget) == (
        untouched.max_sessions, untouched.session_ttl_s, untouched.max_body_bytes,
        untouched.scheduling, untouched.batch_prefill_budget)
    assert config.state_path is None  # --state-db :memory:


def test_serve_flags_convert_units_and_paths(tmp_path):
    args = build_parser().parse_args(["serve", "--max-body-mb", "0.5", "--trace-dir",
                                      str(tmp_path), "--state-db", str(tmp_path / "s.db")])
    flags = serve_flags(args)
    assert flags["max_body_bytes"] == 512 * 1024 and flags["trace_dir"] == tmp_path
    assert flags["state_path"] == Path(tmp_path / "s.db") and "max_queue" not in flags


def test_the_files_api_keys_are_settings_too(monkeypatch):
    monkeypatch.setenv("FLOWLIFT_TEST_KEYS", "k1, k2")
    keyed = parse_config({"server": {"api_keys_env": "FLOWLIFT_TEST_KEYS"}})
    assert settings({}, keyed).api_keys == {"k1", "k2"}


def test_a_flag_that_is_no_setting_is_refused():
    with pytest.raises(ConfigError, match="not a proxy setting: max_qeue"):
        settings({"max_qeue": 1}, FILE)


def test_the_app_reads_only_the_merged_settings():
    engines = {"m": FakeEngine(["m"])}
    from_file = create_app(engines, file_config=FILE)  # no settings: the file's, else defaults
    assert from_file[STATE].backends.max_queue == from_file[STATE].config.max_queue == 3
    flagged = create_app(engines, settings({"max_queue": 7}, FILE), file_config=FILE)
    assert flagged[STATE].backends.max_queue == 7
