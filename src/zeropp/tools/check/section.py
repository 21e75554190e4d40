"""Run one section of ``zeropp check`` in this process (the runner starts one process per
section so it can stop it)::

    python -m zeropp.tools.check.section NAME CONTEXT_JSON RECORD_PATH
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from zeropp.tools.check.record import Context, Record
from zeropp.tools.check.sections import SECTIONS


def main(argv: list[str]) -> int:
    name, context, path = argv
    importlib.import_module(SECTIONS[name].module).run(Context.from_json(context), Record(Path(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
