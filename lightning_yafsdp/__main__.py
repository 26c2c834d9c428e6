"""``python -m lightning_yafsdp`` runs the ``yafsdp`` command."""

from lightning_yafsdp.cli.main import main

raise SystemExit(main())
