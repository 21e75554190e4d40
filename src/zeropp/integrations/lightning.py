"""Lightning: the live audit's rows ([Note: the audit] in ``zeropp.techniques.audit``) logged through the
Trainer's own loggers.

    trainer = L.Trainer(..., callbacks=[ZeroPPAudit()])

with ``audit_every`` set in the ``ZeroPPConfig`` that ``configure_model`` shards with. Each new
row is logged with ``LightningModule.log_dict`` after the training batch it was recorded in, as
``zeropp/audit/<technique>/relative_error``, ``.../bound`` and ``.../over_bound``; every rank
holds the same rows, so nothing is reduced across ranks.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning as L
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError("zeropp.integrations.lightning needs lightning: pip install 'zeropp[lightning]'") from error

from zeropp.techniques.audit import ReportCursor, audit_metrics


class ZeroPPAudit(L.Callback):
    """Log the audit's rows of the LightningModule's zeropp-sharded models as metrics."""

    def __init__(self) -> None:
        self._cursor: ReportCursor | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._cursor is None:
            self._cursor = ReportCursor(pl_module)
        metrics = audit_metrics(self._cursor.new_rows())
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
