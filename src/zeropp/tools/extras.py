"""What a ``zeropp`` subcommand needs beyond the library, and the extra that installs it.

``pip install zeropp`` installs what the library imports (torch, numpy, safetensors); the
command's benchmarks, demo and plots need more (``zeropp[tools]``: matplotlib, tqdm), and so do
some subcommands (``zeropp[finetune]``). A subcommand says so in one line instead of failing on
an import deep inside it.
"""

from __future__ import annotations

import importlib.util
import sys


def require(what: str, extra: str, *packages: str) -> None:
    """Exit with one line naming the packages ``what`` needs and the extra that installs them,
    when any is missing (a library install has none of the tools' packages)."""
    missing = [package for package in packages if importlib.util.find_spec(package) is None]
    if missing:
        sys.exit(f"{what} needs {' and '.join(missing)}, which the '{extra}' extra installs: "
                 f"pip install 'zeropp[{extra}]'")

