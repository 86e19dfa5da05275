"""Tools built on the executor core: the `ferrum-executor` command line (`tools.cli`), `demo`,
`generate` and `bench`.

Tools import the core; the core (everything else in `ferrum_server`) never imports
`ferrum_server.tools`, which tests/unit/test_layering.py checks.
"""
