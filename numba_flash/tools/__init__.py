"""Tooling, never imported by the runtime: the compile tier (``compile_check``), the SASS counter
(``sass``), the docs' pictures (``pictures``), the Philox check kernel (``philox_check``), the
kernel warm-up (``warmup``) and the list of modules with launchable configurations (``catalog``).
"""
