"""The README is the front door: its configuration table must match the settings."""

from pathlib import Path

from core.settings import Settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_setting_is_documented_with_its_default():
    for env, default, help_text in Settings.describe():
        shown_default = f"`{default}`" if default else "—"
        assert f"| `{env}` | {shown_default} | {help_text} |" in README, env


def test_readme_names_the_two_front_door_commands():
    assert "make up" in README and "make test" in README
