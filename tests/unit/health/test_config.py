"""The health config: defaults, TOML and JSON files, and errors that say what is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchpass_slurm.errors import ConfigError
from torchpass_slurm.health.config import HealthConfig, load_config, parse_config


def test_defaults_when_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHPASS_HEALTH_CONFIG", raising=False)
    monkeypatch.setattr("torchpass_slurm.health.config.DEFAULT_CONFIG_PATH", "/nonexistent/health.toml")
    assert load_config() == HealthConfig()


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "health.toml"
    path.write_text(
        "expected_gpus = 8\necc_corrected_rate_warning = 50\nxid_ignore = [13]\ndrain_on_unknown = true\n"
    )
    cfg = load_config(path)
    assert (cfg.expected_gpus, cfg.ecc_corrected_rate_warning, cfg.xid_ignore, cfg.drain_on_unknown) == (
        8,
        50.0,
        (13,),
        True,
    )


def test_json_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "health.json"
    path.write_text('{"timeout_s": 3, "disk_paths": ["/scratch"]}')
    monkeypatch.setenv("TORCHPASS_HEALTH_CONFIG", str(path))
    assert load_config().disk_paths == ("/scratch",)


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"expected_gpu": 4}, origin="/etc/torchpass/health.toml")
    assert caught.value.message == "unknown key(s) in /etc/torchpass/health.toml: expected_gpu"
    assert "expected_gpus" in caught.value.hint and caught.value.hint.startswith("valid keys: auto_resume, ")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"expected_gpus": "four"}, "f: health setting expected_gpus must be int, got 'four'"),
        ({"expected_gpus": True}, "f: health setting expected_gpus must be int, got True"),
        ({"drain_on_unknown": "yes"}, "f: health setting drain_on_unknown must be bool, got 'yes'"),
        ({"disk_paths": "/tmp"}, "f: health setting disk_paths must be a list, got '/tmp'"),
        ({"source": "cuda"}, "f: health setting source = 'cuda' is not one of auto, nvml, amdsmi, simulated"),
        (
            {"pcie_width_status": "bad"},
            "f: health setting pcie_width_status = 'bad' is not one of ok, warning, critical",
        ),
        ({"temperature_margin_c": -1}, "f: health setting temperature_margin_c = -1.0 is negative"),
        ({"timeout_s": 0}, "f: health setting timeout_s = 0.0 must be above 0"),
    ],
)
def test_bad_values(values: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError) as caught:
        parse_config(values, origin="f")
    assert caught.value.message == message


def test_unparsable_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "health.toml"
    bad.write_text("expected_gpus = = 4\n")
    with pytest.raises(ConfigError, match=r"^the health config .*health.toml does not parse: "):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"cannot read the health config .*nope.json: No such file"):
        load_config(tmp_path / "nope.json")
