"""The launcher: the ``sluice`` command line, the ``sluice up`` supervisor, embedded servers.

It imports every other package and is imported by none of them (the tests and benchmarks use
its process harness).
"""
