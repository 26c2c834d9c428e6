"""The ``yafsdp`` command line."""
