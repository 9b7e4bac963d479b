"""`python -m validation_service.cli`: the `ckval` command line."""

from validation_service.cli import main

main()
