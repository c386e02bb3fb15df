"""The live picture for operators: ``/admin/status`` and ``tierproxy top``."""
