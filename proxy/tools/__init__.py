"""The command-line tools beside the served proxy — what ``tierproxy`` runs besides ``serve``:
`tierproxy keys` editing the config file (``keys``, ``keys_cli``, ``keyedit``, ``keyfile``),
local vLLM engines with the plugin (``engine``) and the tiny generated model
(``tiny_model``), and the usage report read from the usage log (``usage_report``).

Beside ``server`` (neither imports the other); used by ``cli`` and ``bench``. May import
``ops`` and every floor below.
"""
