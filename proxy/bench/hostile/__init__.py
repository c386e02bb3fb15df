"""The served-process kit: `tierproxy serve` started as a subprocess in front of a fake backend
(``served``), hostile raw-socket clients (``kit``) and the figures they take (``measure``).
The served adversarial tests and ``benchmarks/hostile.py`` both use it."""
