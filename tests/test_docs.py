"""The documentation site: it builds in strict mode, and a broken link fails that build."""

import logging
import shutil

import pytest
import yaml
from suite import REPO

mkdocs_build = pytest.importorskip("mkdocs.commands.build", reason="mkdocs-material is in the dev extra")


def build_site(config_file, site_dir) -> None:
    """``mkdocs build --strict`` of ``config_file`` into ``site_dir``, in this process."""
    from mkdocs.config import load_config

    mkdocs_build.build(load_config(str(config_file), strict=True, site_dir=str(site_dir)))


def copy_of_site_sources(tmp_path):
    """mkdocs.yml and docs/ copied under ``tmp_path``; returns the copy's mkdocs.yml."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path / "mkdocs.yml"


def test_site_builds_in_strict_mode(tmp_path):
    build_site(REPO / "mkdocs.yml", tmp_path / "site")
    assert (tmp_path / "site" / "index.html").is_file()


def test_a_broken_link_fails_the_strict_build(tmp_path, caplog):
    config = copy_of_site_sources(tmp_path)
    # Added to the navigation, so only its link is wrong.
    (tmp_path / "docs" / "broken.md").write_text("# Broken\n\nSee [the missing page](no-such-page.md).\n")
    settings = yaml.safe_load(config.read_text())
    settings["nav"].append({"Broken": "broken.md"})
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    from mkdocs.exceptions import Abort

    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort, match="strict mode"):
        build_site(config, tmp_path / "site")
    assert "no-such-page.md" in caplog.text
