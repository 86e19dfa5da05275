import sys

from ferrum_server.cli import main

sys.exit(main())
