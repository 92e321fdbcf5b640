"""Config: YAML -> frozen dataclass; every error names the key."""
from __future__ import annotations

import dataclasses

import pytest

from slurmckpt.config import Config
from slurmckpt.errors import ConfigError


def test_defaults_without_file(tmp_path):
    c = Config.load(tmp_path / "absent.yaml")
    assert c == Config()
    assert c.keep_epochs == 2 and c.prepare_timeout_s == 30.0


def test_unknown_key_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        Config.from_mapping({"keep_epoch": 3})
    assert "'keep_epoch'" in str(e.value) and "unknown key" in str(e.value)
    assert "keep_epochs" in str(e.value)          # lists what is known


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("storage_root: /x\nbogus_option: 1\n")
    with pytest.raises(ConfigError) as e:
        Config.load(p)
    assert str(p) in str(e.value) and "'bogus_option'" in str(e.value)


@pytest.mark.parametrize("key,value,why", [
    ("keep_epochs", "three", "invalid literal"),
    ("keep_epochs", -1, ">= 0"),
    ("keep_epochs", "1.5", "invalid literal"),
    ("gpu_lock_timeout_ms", [1], ""),
    ("prepare_timeout_s", 0, "> 0"),
    ("prepare_timeout_s", -3.5, "> 0"),
    ("capture_timeout_s", "soon", "could not convert"),
    ("storage_root", 17, "must be a string"),
    ("criu_path", None, "must be a string"),
    ("gpu_growth_defaults", "sometimes", "want true or false"),
])
def test_bad_values_name_key_and_value(key, value, why):
    with pytest.raises(ConfigError) as e:
        Config.from_mapping({key: value}, source="t.yaml")
    msg = str(e.value)
    assert msg.startswith("t.yaml: key '" + key + "'")
    assert repr(value) in msg and why in msg


def test_values_are_coerced(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("keep_epochs: '5'\nprepare_timeout_s: 2\nstorage_root: /srv/ckpt\n"
                 "criu_extra_args: [--shell-job, -v4]\n")
    c = Config.load(p)
    assert c.keep_epochs == 5 and isinstance(c.keep_epochs, int)
    assert c.prepare_timeout_s == 2.0 and isinstance(c.prepare_timeout_s, float)
    assert c.storage_root == "/srv/ckpt"
    assert c.criu_extra_args == ("--shell-job", "-v4")
    assert Config.from_mapping({"criu_extra_args": "--a  --b"}).criu_extra_args == ("--a", "--b")
    assert Config.from_mapping({"gpu_growth_defaults": "no"}).gpu_growth_defaults is False
    assert Config.from_mapping({"gpu_growth_defaults": True}).gpu_growth_defaults is True


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().keep_epochs = 9  # type: ignore[misc]


@pytest.mark.parametrize("text", ["keep_epochs: [1\n", "a: b: c\n"])
def test_invalid_yaml(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        Config.load(p)


def test_not_a_mapping(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("- keep_epochs\n- 3\n")
    with pytest.raises(ConfigError, match="mapping"):
        Config.load(p)


def test_empty_file_is_defaults(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("# nothing\n")
    assert Config.load(p) == Config()


def test_environment_override_and_its_errors(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("keep_epochs: 4\n")
    c = Config.load(p, environ={"SLURMCKPT_CFG_KEEP_EPOCHS": "7", "UNRELATED": "x"})
    assert c.keep_epochs == 7
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        Config.load(p, environ={"SLURMCKPT_CFG_NOPE": "1"})
    with pytest.raises(ConfigError, match="key 'keep_epochs'"):
        Config.load(p, environ={"SLURMCKPT_CFG_KEEP_EPOCHS": "many"})


def test_environment_ignored_without_environ_argument(tmp_path, monkeypatch):
    """The root agent calls Config.load() without environ: a user's environment must not move storage."""
    monkeypatch.setenv("SLURMCKPT_CFG_STORAGE_ROOT", "/tmp/evil")
    assert Config.load(tmp_path / "absent.yaml").storage_root == Config().storage_root


def test_duplicate_key_is_an_error(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("capture_timeout_s: 600\ncapture_timeout_s: 60\n")
    with pytest.raises(ConfigError, match="capture_timeout_s"):
        Config.load(p)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_timeouts_refused(value):
    with pytest.raises(ConfigError):
        Config.from_mapping({"capture_timeout_s": value})
