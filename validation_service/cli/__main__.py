"""`python -m validation_service.cli`: the `ckval` command line."""

from validation_service.cli import main

try:
    main()
finally:
    # A Ctrl-C that lands while exec() or eval() runs a string (dataclasses and namedtuple
    # build their methods so while modules import) stays marked as unhandled in CPython
    # even after the command caught it, and `python -m` then ends by SIGINT instead of
    # the command's exit status. Running one string clears the mark (the `ckval` script
    # exits through sys.exit and never looks at it).
    exec("")
