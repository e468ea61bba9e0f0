"""``condinit init`` over the coverage sweep's architectures: is each written, and are the files
drawn in pieces byte-identical to the same write with every module initialized whole?

For each transformers model type (default: those the README's "Which models" table lists as
conditioned), the tiny config of ``tests/coverage_models.py`` is written twice with
``write_pretrained`` (seed 3, 200 kB shards): as ``condinit init`` writes it, and with every module
materialized whole (the model's init run on real tensors). Prints one line per type (``same``,
``DIFFERENT`` or the refusal) and a count.

    python tools/init_sweep.py                 # every conditioned type of the README table
    python tools/init_sweep.py llama clip t5   # these types
"""
from __future__ import annotations

import hashlib
import pathlib
import re
import shutil
import sys
import tempfile
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _digests(d: pathlib.Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    warnings.filterwarnings("ignore")
    from coverage_models import CONFIG_FIXES, hf_config

    from condinit.models.stream import tuned, write_pretrained

    types = list(argv if argv is not None else sys.argv[1:])
    if not types:
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        types = re.findall(r"\| transformers `([^`]+)` \| conditioned", readme)
    counts = {"same": 0, "DIFFERENT": 0, "refused": 0}
    root = pathlib.Path(tempfile.mkdtemp(prefix="condinit-init-sweep-"))
    try:
        for mt in types:
            cfg = hf_config(mt)
            if mt in CONFIG_FIXES:
                CONFIG_FIXES[mt](cfg)
            out = {}
            try:
                for mode in ("pieces", "whole"):
                    d = root / mode
                    shutil.rmtree(d, ignore_errors=True)
                    with tuned(replay_units=mode == "pieces"):
                        write_pretrained(cfg, d, seed=3, max_shard_size="200KB")
                    out[mode] = _digests(d)
            except (ValueError, TypeError) as exc:
                counts["refused"] += 1
                print(f"{mt}: refused: {str(exc)[:160]}", flush=True)
                continue
            verdict = "same" if out["pieces"] == out["whole"] else "DIFFERENT"
            counts[verdict] += 1
            print(f"{mt}: {verdict}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(types)} types: {counts['same']} written, pieces = whole; {counts['DIFFERENT']} different; "
          f"{counts['refused']} refused")
    return 1 if counts["DIFFERENT"] else 0


if __name__ == "__main__":
    sys.exit(main())
