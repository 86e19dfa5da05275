# `python -m ferrum_server` is the `ferrum-executor` program: an entry point like the console
# script, never imported by the core, so it alone may reach into `ferrum_server.tools`.
import sys

from ferrum_server.tools.cli import main

sys.exit(main())
