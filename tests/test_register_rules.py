"""`Registry.register` and `ckval register`, on SQLite and PostgreSQL: a URI that carries
credentials is refused (never stored nor echoed), and a folder follows the rule a
NO_UPLOAD report follows: nothing of ckval's storage but the run's own folder, no folder
holding a storage root or CKVAL_HOME, no system folder."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from validation_service.cli import main
from validation_service.config import Settings
from validation_service.errors import InvalidInput
from validation_service.registry.registry import Registry

PASSWORD = "Sup3r-s3cret"


@pytest.fixture
def settings(registry, tmp_path) -> Settings:
    url = registry.engine.url.render_as_string(hide_password=False)
    return Settings(home=tmp_path / "home", database_url=url, storage=str(tmp_path / "s"))


@pytest.fixture
def reg(settings):
    opened = Registry(settings=settings)
    yield opened
    opened.close()


def ckval(settings: Settings, *args: str):
    env = {"CKVAL_STORAGE": settings.storage, "CKVAL_HOME": str(settings.home)}
    return CliRunner().invoke(main, ["--database-url", settings.database_url, *args], env=env)


@pytest.mark.parametrize(
    "uri",
    [
        f"http://alice:{PASSWORD}@models.example/model/",
        f"https://{PASSWORD}@models.example/model/",
        f"https://models.example/model/?token={PASSWORD}",
        f"s3://bucket/model?aws_secret_access_key={PASSWORD}",
    ],
)
def test_a_uri_with_credentials_is_refused_and_never_shown(reg, settings, unique_run, uri):
    with pytest.raises(InvalidInput, match=r"carries credentials") as refused:
        reg.register(unique_run, uri)
    shell = ckval(settings, "register", unique_run, uri)

    assert PASSWORD not in str(refused.value) and "***" in str(refused.value)
    assert shell.exit_code == 2 and "carries credentials" in shell.output
    assert PASSWORD not in shell.output
    assert reg.find_run_id(unique_run) is None  # nothing stored


def test_register_follows_the_folder_rule_of_no_upload(reg, settings, tmp_path, unique_run):
    storage = tmp_path / "s"
    theirs = storage / "team-a" / "their-run" / "checkpoint_000000"
    own = storage / "default" / unique_run / "released"
    for folder in (theirs, own, settings.home / "cache"):
        folder.mkdir(parents=True)
        (folder / "w.bin").write_bytes(b"w")
    refused = {
        str(theirs): "not inside run",
        str(storage): "not inside run",
        str(tmp_path): "it holds ckval's storage root",
        str(settings.home / "cache"): "CKVAL_HOME",
        "/etc": "system folder",
    }

    for folder, why in refused.items():
        with pytest.raises(InvalidInput, match=why):
            reg.register(unique_run, folder)
    shell = ckval(settings, "register", unique_run, "/etc")
    index = reg.register(unique_run, str(own))

    assert shell.exit_code == 2 and "system folder" in shell.output, shell.output
    assert index == 0 and [r.uri for r in reg.checkpoints(unique_run)] == [str(own)]
