"""The database layer: an unreachable database is one error, RegistryUnavailable."""

from __future__ import annotations

import pickle

import pytest
from sqlalchemy.exc import DBAPIError

from validation_service import CkvalError, Registry, RegistryUnavailable
from validation_service.registry.database import masked_url

# Nothing listens on port 1: every connection is refused at once.
UNREACHABLE = "postgresql+psycopg://ckval:secret@127.0.0.1:1/ckval"


def test_an_unreachable_database_raises_registry_unavailable():
    registry = Registry(UNREACHABLE, check_schema=False)
    with pytest.raises(RegistryUnavailable) as caught:
        registry.find_run_id("run-a")
    error = caught.value
    # Still a DBAPIError, so code that catches the driver's errors keeps working.
    assert isinstance(error, CkvalError) and isinstance(error, DBAPIError)
    assert error.disconnect and error.orig is not None
    assert "secret" not in str(error) and "ckval:***@127.0.0.1:1" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RegistryUnavailable and str(copy) == str(error)


def test_masked_url_hides_the_password():
    assert masked_url(UNREACHABLE) == "postgresql+psycopg://ckval:***@127.0.0.1:1/ckval"
    assert repr(Registry(UNREACHABLE, check_schema=False)).startswith(
        "Registry('postgresql+psycopg://ckval:***@"
    )
