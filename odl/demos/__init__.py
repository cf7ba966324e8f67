"""The demos run by ``make demo``, ``make demo-cloud`` and ``make demo-filestream``.

They run from a checkout (they read ``samples/`` and write under ``.odl/``) and are not part
of the installed package.
"""
