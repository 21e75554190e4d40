"""``python -m zeropp.tools.check``: the same as ``zeropp check``."""

from zeropp.tools.check.cli import main

main()
