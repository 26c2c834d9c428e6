"""Test suite; a package so that tests import helpers as ``tests.distributed``."""
