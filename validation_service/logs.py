"""How much ckval logs: CKVAL_LOG_LEVEL (default WARNING) for its own and Alembic's loggers."""

from __future__ import annotations

import logging
import os

# Alembic logs every schema check at INFO ("Context impl", "setup plugin"): in each
# training worker that opens the registry, that would be noise in the user's output.
LOGGERS = ("validation_service", "trainer_integration", "alembic")
DEFAULT_LEVEL = "WARNING"


def configure_logging(level: str | None = None) -> None:
    """Sets ckval's loggers to ``level`` (else CKVAL_LOG_LEVEL, else WARNING).

    Below WARNING, their records go to stderr even when the program configured no
    logging, so that CKVAL_LOG_LEVEL=INFO shows them in training workers too.
    """
    name = (level or os.environ.get("CKVAL_LOG_LEVEL") or DEFAULT_LEVEL).strip().upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        logging.getLogger(__name__).warning(
            "CKVAL_LOG_LEVEL=%r is not a logging level (use DEBUG, INFO, WARNING or ERROR); "
            "using %s",
            name,
            DEFAULT_LEVEL,
        )
        numeric = logging.getLevelName(DEFAULT_LEVEL)
    for logger_name in LOGGERS:
        logger = logging.getLogger(logger_name)
        logger.setLevel(numeric)
        if numeric < logging.WARNING and not logging.getLogger().handlers:
            if not any(getattr(h, "_ckval", False) for h in logger.handlers):
                handler = logging.StreamHandler()
                handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
                handler._ckval = True  # type: ignore[attr-defined]
                logger.addHandler(handler)
