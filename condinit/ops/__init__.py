"""condinit's kernel-backed ops, one subpackage per op family (``attention``). The public entry
points are re-exported from :mod:`condinit` (``condinit.attention``, ``condinit.attention_jvp``)."""
